-- bad_negative_updates for any delta (analysis_param('bad_negative_delta')), scanning the tokens.
with per_step as (
    select
        run_id,
        step,
        count(*) as n_tokens,
        count_if(advantage < 0) as n_negative,
        count_if(advantage < 0 and mu_prob - pi_prob >= analysis_param('bad_negative_delta')) as n_bad_negative
    from token_metrics_core
    group by run_id, step
),

rewards as (
    select run_id, step, avg(reward) as reward_mean, stddev_pop(reward) as reward_std
    from samples
    group by run_id, step
),

final as (
    select
        per_step.run_id,
        per_step.step,
        n_tokens,
        n_negative,
        n_bad_negative,
        n_bad_negative / n_tokens as bad_negative_rate,
        reward_mean,
        reward_std,
        abs(reward_mean - lag(reward_mean) over (partition by per_step.run_id order by per_step.step))
            as reward_change
    from per_step
    left join rewards using (run_id, step)
    order by per_step.run_id, per_step.step
)

select * from final
