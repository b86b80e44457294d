-- how far the ratio and binary tv stray per mu bucket (99th percentiles) in run $run_id, steps
-- $first_step..$last_step.
with window_tokens as (
    select mu_bucket, abs(ratio - 1) as ratio_dev, binary_tv as tv
    from token_metrics_core
    where run_id = $run_id and step between $first_step and $last_step
),

final as (
    select
        mu_bucket,
        count(*) as n_tokens,
        quantile_cont(ratio_dev, 0.99) as ratio_dev,
        quantile_cont(tv, 0.99) as tv
    from window_tokens
    group by mu_bucket
    order by mu_bucket
)

select * from final
