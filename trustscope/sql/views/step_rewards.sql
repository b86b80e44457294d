-- one row per (run, step) of samples (always logged in full, whatever token_fraction keeps of the tokens): how
-- many responses, their mean and population standard deviation of reward, their mean length. step_summary and
-- summary_steps read it.
with final as (
    select
        run_id,
        step,
        count(*) as n_samples,
        avg(reward) as reward_mean,
        stddev_pop(reward) as reward_std,
        avg(length) as length_mean
    from samples
    group by run_id, step
)

select * from final
