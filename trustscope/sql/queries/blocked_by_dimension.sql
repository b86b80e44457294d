-- the page "where the mismatch lives" and the report: per run, summary dimension, bucket and rule, over the steps
-- [$first_step, $last_step] (null: every step) taken together: the tokens the rule blocks among those that carry
-- gradient (a != 0), and their fraction, exact from the summaries' dimension rows (the sums of
-- summary_dimension_blocked's per-step rows, summed here in one pass: every rule of the run at every bucket, 0 where it
-- blocked nothing). $run_ids: the runs, or null for all. a run logged in full without dimension rows (an import) gets
-- the same rows from its token rows: blocked_by_dimension_tokens, which trustscope.report_where.by_dimension runs for
-- the runs this one leaves out.
with summ as (
    select run_id, step, metric, rule, advantage_sign, dimension, bucket, count
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where ((dimension is not null and metric in ('tokens', 'blocked')) or metric = 'threshold_hist')
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
),

in_steps as (
    select *
    from summ
    where dimension is not null
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

buckets as (
    select run_id, dimension, bucket, sum(count)::bigint as n_nonzero_advantage
    from in_steps
    where metric = 'tokens' and advantage_sign != 'zero'
    group by all
),

rules as (  -- the run's rules over every step, as summary_dimension_blocked has them
    select distinct run_id, rule from summ where metric in ('blocked', 'threshold_hist') and rule is not null
),

blocked as (
    select run_id, dimension, bucket, rule, sum(count)::bigint as n_blocked
    from in_steps
    where metric = 'blocked'
    group by all
),

final as (
    select
        b.run_id,
        b.dimension,
        b.bucket,
        bucket_label(b.dimension, b.bucket) as bucket_label,
        r.rule,
        coalesce(k.n_blocked, 0)::bigint as n_blocked,
        b.n_nonzero_advantage,
        coalesce(k.n_blocked, 0) / nullif(b.n_nonzero_advantage, 0) as blocked_frac
    from buckets as b
    join rules as r using (run_id)
    left join blocked as k using (run_id, dimension, bucket, rule)
)

select * from final order by run_id, dimension, rule, bucket
