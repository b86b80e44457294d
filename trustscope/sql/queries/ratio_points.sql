-- a uniform sample of at most 8,000 tokens of run $run_id in steps $first_step..$last_step: mu, the ratio pi / mu,
-- binary and top-k tv and the mu bucket, for the ratio-versus-divergence scatter.
with window_tokens as (
    select mu_prob as mu, ratio, binary_tv as tv, topk_tv, mu_bucket
    from token_metrics_core
    where run_id = $run_id and step between $first_step and $last_step
),

final as (
    select *
    from window_tokens
    using sample reservoir (8000 rows) repeatable (7)
)

select * from final
