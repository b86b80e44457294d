-- one row per (run, step): mismatch |pi - mu| mean and max, signed max/min of pi - mu, top-k tv/kl, blocked
-- count and fraction of every rule over the tokens that carry gradient (a != 0) and by advantage sign (pos: a > 0,
-- neg: a < 0), bad negative-update rate (a < 0 and mu - pi >= delta), the trainer's own blocked fraction (over
-- a != 0 too), entropy and reward.
-- reads the kept per-file partial aggregates (step_partials_cache), filled by trustscope.db before each query.
with partials as (
    select * from step_partials_cache
),

merged as (
    select
        run_id,
        step,
        sum(n_tokens)::bigint as n_tokens,
        sum(n_positive)::bigint as n_positive,
        sum(n_nonzero_advantage)::bigint as n_nonzero_advantage,
        sum(n_negative)::bigint as n_negative,
        sum(n_zero_advantage)::bigint as n_zero_advantage,
        sum(sum_abs_prob_diff) as sum_abs_prob_diff,
        max(max_abs_prob_diff) as mismatch_max,
        max(max_prob_diff) as prob_diff_max,
        min(min_prob_diff) as prob_diff_min,
        sum(sum_binary_kl) as sum_binary_kl,
        max(max_binary_kl) as binary_kl_max,
        sum(n_topk)::bigint as n_topk,
        sum(sum_topk_tv) as sum_topk_tv,
        max(max_topk_tv) as topk_tv_max,
        sum(sum_topk_kl) as sum_topk_kl,
        max(max_topk_kl) as topk_kl_max,
        max(max_ratio) as ratio_max,
        min(min_ratio) as ratio_min,
        sum(n_entropy)::bigint as n_entropy,
        sum(sum_entropy) as sum_entropy,
        sum(n_bad_negative)::bigint as n_bad_negative,
        sum(n_trainer_blocked)::bigint as n_trainer_blocked,
        sum(columns('^n_blocked(_pos|_neg|)__(.*)$'))::bigint as 'n_blocked\1__\2'
    from partials
    group by run_id, step
),

rewards as (
    select * from step_rewards
),

final as (
    select
        merged.run_id,
        merged.step,
        merged.n_tokens,
        rewards.n_samples,
        rewards.reward_mean,
        rewards.reward_std,
        rewards.length_mean,
        sum_abs_prob_diff / n_tokens as mismatch_mean,
        mismatch_max,
        prob_diff_max,
        prob_diff_min,
        sum_binary_kl / n_tokens as binary_kl_mean,
        binary_kl_max,
        sum_topk_tv / nullif(n_topk, 0) as topk_tv_mean,
        topk_tv_max,
        sum_topk_kl / nullif(n_topk, 0) as topk_kl_mean,
        topk_kl_max,
        ratio_min,
        ratio_max,
        sum_entropy / nullif(n_entropy, 0) as entropy_mean,
        n_positive,
        n_negative,
        n_zero_advantage,
        n_bad_negative,
        n_bad_negative / n_tokens as bad_negative_rate,
        n_nonzero_advantage,
        n_trainer_blocked,
        n_trainer_blocked / nullif(n_nonzero_advantage, 0) as trainer_blocked_frac,
        columns('^n_blocked(_pos|_neg|)__.*$'),
        columns('^n_blocked__(.*)$') / nullif(n_nonzero_advantage, 0) as 'blocked_frac__\1',
        columns('^n_blocked_pos__(.*)$') / nullif(n_positive, 0) as 'blocked_frac_pos__\1',
        columns('^n_blocked_neg__(.*)$') / nullif(n_negative, 0) as 'blocked_frac_neg__\1'
    from merged
    left join rewards using (run_id, step)
    order by merged.run_id, merged.step
)

select * from final
