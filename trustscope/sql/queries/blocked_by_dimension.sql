-- the page "where the mismatch lives" and the report: per run, summary dimension, bucket and rule, over the steps
-- [$first_step, $last_step] (null: every step) taken together: the tokens the rule blocks among those that carry
-- gradient (a != 0), and their fraction. $run_ids: the runs, or null for all.
with rows as (
    select *
    from summary_dimension_blocked
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

final as (
    select
        run_id,
        dimension,
        bucket,
        any_value(bucket_label) as bucket_label,
        rule,
        sum(n_blocked)::bigint as n_blocked,
        sum(n_nonzero_advantage)::bigint as n_nonzero_advantage,
        sum(n_blocked) / nullif(sum(n_nonzero_advantage), 0) as blocked_frac
    from rows
    group by run_id, dimension, bucket, rule
)

select * from final order by run_id, dimension, rule, bucket
