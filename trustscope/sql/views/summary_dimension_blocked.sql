-- one row per (run, step, summary dimension, bucket, rule): the tokens each rule the logger ran blocks among the
-- bucket's tokens that carry gradient (a != 0), exact over every token (the summaries' blocked rows by dimension);
-- every rule of the run appears at every bucket of a step, with 0 where it blocked nothing (the run's rules: those
-- with blocked rows or a threshold histogram, so a rule that never blocked a token in the run still has its zeros).
with summ as (
    select run_id, step, metric, rule, advantage_sign, dimension, bucket, count
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where (dimension is not null and metric in ('tokens', 'blocked')) or metric = 'threshold_hist'
),

buckets as (
    select run_id, step, dimension, bucket, sum(count)::bigint as n_nonzero_advantage
    from summ
    where metric = 'tokens' and dimension is not null and advantage_sign != 'zero'
    group by all
),

rules as (
    select distinct run_id, rule from summ where metric in ('blocked', 'threshold_hist') and rule is not null
),

blocked as (
    select run_id, step, dimension, bucket, rule, sum(count)::bigint as n_blocked
    from summ
    where metric = 'blocked' and dimension is not null
    group by all
),

final as (
    select
        b.run_id,
        b.step,
        b.dimension,
        b.bucket,
        bucket_label(b.dimension, b.bucket) as bucket_label,
        r.rule,
        coalesce(k.n_blocked, 0)::bigint as n_blocked,
        b.n_nonzero_advantage,
        coalesce(k.n_blocked, 0) / nullif(b.n_nonzero_advantage, 0) as blocked_frac
    from buckets as b
    join rules as r using (run_id)
    left join blocked as k using (run_id, step, dimension, bucket, rule)
    order by b.run_id, b.dimension, r.rule, b.step, b.bucket
)

select * from final
