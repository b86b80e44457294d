-- one row per (run, step) of the runs that have a summaries table: the early-warning signals, exact over every
-- token the trainer handed to the logger (the summaries' importance-weight rows, see trustscope/logger/summaries.py),
-- beside summary_steps' mismatch, entropy, blocked and bad-update figures and the step's grad norm (a step scalar,
-- null where not logged). ess_frac: the effective sample size of the step's importance weights w = pi / mu,
-- (sum w)^2 / sum w^2, over the token count (1 = every weight equal); seq_ess_frac: the same over the responses'
-- geometric-mean weights exp(mean log-ratio). seq_log_ratio_p50 / _p90 / _p99: quantiles of |mean log-ratio| per
-- response, the bin_high of the first histogram bin reaching the share (exact to bin resolution, 8 bins a decade);
-- seq_log_ratio_max: its exact maximum. The *_slope columns: least-squares slope per step over the last 10 steps
-- (this one and the 9 before; null before the run has 3), of entropy_mean, mismatch_mean and trainer_blocked_frac.
with summ as (
    select metric, run_id, step, count, sum, sum_sq, min, max
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where metric in ('is_weight', 'log_ratio', 'seq_is_weight', 'abs_seq_log_ratio') and dimension is null
),

ratios as (
    select
        run_id,
        step,
        sum(sum) filter (where metric = 'is_weight') as w_sum,
        sum(sum_sq) filter (where metric = 'is_weight') as w_sum_sq,
        sum(count) filter (where metric = 'is_weight')::bigint as w_count,
        sum(sum) filter (where metric = 'seq_is_weight') as sw_sum,
        sum(sum_sq) filter (where metric = 'seq_is_weight') as sw_sum_sq,
        sum(count) filter (where metric = 'seq_is_weight')::bigint as n_responses,
        max(max) filter (where metric = 'is_weight') as is_weight_max,
        min(min) filter (where metric = 'log_ratio') as log_ratio_min,
        max(max) filter (where metric = 'log_ratio') as log_ratio_max,
        sum(sum) filter (where metric = 'log_ratio') as lr_sum,
        sum(sum_sq) filter (where metric = 'log_ratio') as lr_sum_sq,
        max(max) filter (where metric = 'abs_seq_log_ratio') as seq_log_ratio_max
    from summ
    group by run_id, step
),

tails as (
    select
        run_id,
        step,
        min(bin_high) filter (where cum_fraction >= 0.5) as seq_log_ratio_p50,
        min(bin_high) filter (where cum_fraction >= 0.9) as seq_log_ratio_p90,
        min(bin_high) filter (where cum_fraction >= 0.99) as seq_log_ratio_p99
    from summaries
    where metric = 'abs_seq_log_ratio_hist'
    group by run_id, step
),

grad as (
    select run_id, step, max(value) filter (where not isnan(value)) as grad_norm
    from steps
    where name = 'grad_norm'
    group by run_id, step
),

joined as (
    select
        s.run_id,
        s.step,
        s.n_tokens,
        r.n_responses,
        s.reward_mean,
        r.w_sum * r.w_sum / nullif(r.w_sum_sq, 0) / nullif(r.w_count, 0) as ess_frac,
        r.sw_sum * r.sw_sum / nullif(r.sw_sum_sq, 0) / nullif(r.n_responses, 0) as seq_ess_frac,
        r.is_weight_max,
        r.log_ratio_min,
        r.log_ratio_max,
        sqrt(case when r.lr_sum_sq / r.w_count - pow(r.lr_sum / r.w_count, 2) > 0
            then r.lr_sum_sq / r.w_count - pow(r.lr_sum / r.w_count, 2) else 0 end) as log_ratio_std,
        t.seq_log_ratio_p50,
        t.seq_log_ratio_p90,
        t.seq_log_ratio_p99,
        r.seq_log_ratio_max,
        s.mismatch_mean,
        s.entropy_mean,
        s.bad_negative_rate,
        s.trainer_blocked_frac,
        g.grad_norm
    from summary_steps as s
    left join ratios as r using (run_id, step)
    left join tails as t using (run_id, step)
    left join grad as g using (run_id, step)
),

final as (
    select
        *,
        case when count(entropy_mean) over recent >= 3 then regr_slope(entropy_mean, step) over recent end
            as entropy_slope,
        case when count(mismatch_mean) over recent >= 3 then regr_slope(mismatch_mean, step) over recent end
            as mismatch_slope,
        case when count(trainer_blocked_frac) over recent >= 3
            then regr_slope(trainer_blocked_frac, step) over recent end as blocked_slope
    from joined
    window recent as (partition by run_id order by step rows between 9 preceding and current row)
    order by run_id, step
)

select * from final
