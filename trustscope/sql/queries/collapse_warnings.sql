-- the collapse early warning of every run in $run_ids, per step: over the last $window steps, the rate of bad
-- negative updates (a < 0 and mu - pi >= delta, of all tokens) and the mean |pi - mu| against the run's first
-- $window steps. a step warns when the rate reaches $bad_rate_line or the mismatch has grown $mismatch_growth_line
-- times; the first full window of a run is its baseline and never warns.
with summary as (
    select run_id, step, n_tokens, n_bad_negative, mismatch_mean, reward_mean
    from step_summary
    where list_contains($run_ids, run_id)
),

windowed as (
    select
        run_id,
        step,
        reward_mean,
        row_number() over (partition by run_id order by step) as step_index,
        sum(n_bad_negative) over recent as n_bad_recent,
        sum(n_tokens) over recent as n_tokens_recent,
        avg(mismatch_mean) over recent as mismatch_recent
    from summary
    window recent as (partition by run_id order by step rows between $window - 1 preceding and current row)
),

baseline as (
    select run_id, avg(mismatch_mean) as mismatch_baseline
    from (
        select run_id, mismatch_mean, row_number() over (partition by run_id order by step) as step_index
        from summary
    )
    where step_index <= $window
    group by run_id
),

final as (
    select
        windowed.run_id,
        step,
        reward_mean,
        n_bad_recent / nullif(n_tokens_recent, 0) as bad_rate_recent,
        mismatch_recent / nullif(mismatch_baseline, 0) as mismatch_growth,
        step_index > $window and n_bad_recent / nullif(n_tokens_recent, 0) >= $bad_rate_line as warn_bad_rate,
        step_index > $window and mismatch_recent / nullif(mismatch_baseline, 0) >= $mismatch_growth_line
            as warn_mismatch
    from windowed
    join baseline using (run_id)
    order by windowed.run_id, step
)

select *, coalesce(warn_bad_rate, false) or coalesce(warn_mismatch, false) as warning from final
