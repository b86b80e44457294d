-- per step: the rate of bad negative updates (a < 0 and mu - pi >= delta, delta = minimal_negative_mask's
-- default) beside the reward's level and its fluctuation from the previous step. reads step_summary.
with summary as (
    select run_id, step, n_tokens, n_negative, n_bad_negative, bad_negative_rate, reward_mean, reward_std
    from step_summary
),

final as (
    select
        *,
        abs(reward_mean - lag(reward_mean) over (partition by run_id order by step)) as reward_change
    from summary
    order by run_id, step
)

select * from final
