-- one row per (run, step, summary dimension, bucket) of the runs whose summaries have dimension rows (position,
-- turn, staleness: see trustscope/columns.py), exact over every token the trainer handed to the logger: the token
-- counts (all, and those that carry gradient: a != 0), the mismatch |pi - mu| mean and max, the effective sample
-- size of the importance weights w = pi / mu over the bucket's tokens (ess_frac = (sum w)^2 / sum w^2 / n), the bad
-- negative-update count and rate, and top-k tv mean where logged. a dimension a run's tokens lack (no turn, no
-- policy_version) has no rows for that run.
with summ as (
    select run_id, step, metric, advantage_sign, dimension, bucket, count, sum, sum_sq, max
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where dimension is not null
        and metric in ('tokens', 'abs_prob_diff', 'is_weight', 'bad_negative', 'topk_tv')
),

per_bucket as (
    select
        run_id,
        step,
        dimension,
        bucket,
        sum(count) filter (where metric = 'tokens')::bigint as n_tokens,
        sum(count) filter (where metric = 'tokens' and advantage_sign != 'zero')::bigint as n_nonzero_advantage,
        sum(sum) filter (where metric = 'abs_prob_diff') as sum_abs_prob_diff,
        max(max) filter (where metric = 'abs_prob_diff') as mismatch_max,
        sum(sum) filter (where metric = 'is_weight') as w_sum,
        sum(sum_sq) filter (where metric = 'is_weight') as w_sum_sq,
        sum(count) filter (where metric = 'bad_negative')::bigint as n_bad_negative,
        sum(count) filter (where metric = 'topk_tv')::bigint as n_topk,
        sum(sum) filter (where metric = 'topk_tv') as sum_topk_tv
    from summ
    group by all
),

final as (
    select
        run_id,
        step,
        dimension,
        bucket,
        bucket_label(dimension, bucket) as bucket_label,
        n_tokens,
        coalesce(n_nonzero_advantage, 0)::bigint as n_nonzero_advantage,
        sum_abs_prob_diff,
        sum_abs_prob_diff / nullif(n_tokens, 0) as mismatch_mean,
        mismatch_max,
        w_sum,
        w_sum_sq,
        w_sum * w_sum / nullif(w_sum_sq, 0) / nullif(n_tokens, 0) as ess_frac,
        n_bad_negative,
        n_bad_negative / nullif(n_tokens, 0) as bad_negative_rate,
        sum_topk_tv / nullif(n_topk, 0) as topk_tv_mean
    from per_bucket
    order by run_id, dimension, step, bucket
)

select * from final
