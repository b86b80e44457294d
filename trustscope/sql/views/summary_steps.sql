-- one row per (run, step) of the runs that have a summaries table: the overview's per-step figures, exact over
-- every token the trainer handed to the logger (whatever token_fraction kept), with step_summary's column names
-- and definitions: blocked counts (trainer_blocked) over the tokens that carry gradient (a != 0), the bad
-- negative-update rate (a < 0 and mu - pi >= the delta the logger used) and the mismatch mean over all tokens.
-- reward and length come from samples (always logged in full). reads the summaries files (merging the parts of a
-- step and the ranks of a run as the summaries view does), never the token rows.
with summ as (
    select metric, run_id, step, advantage_sign, threshold, count, sum, min, max
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where metric in ('tokens', 'trainer_blocked', 'bad_negative', 'abs_prob_diff', 'prob_diff', 'topk_tv',
                     'topk_kl', 'entropy')
        and dimension is null
),

per_step as (
    select
        run_id,
        step,
        sum(count) filter (where metric = 'tokens')::bigint as n_tokens,
        sum(count) filter (where metric = 'tokens' and advantage_sign = 'positive')::bigint as n_positive,
        sum(count) filter (where metric = 'tokens' and advantage_sign = 'negative')::bigint as n_negative,
        sum(count) filter (where metric = 'tokens' and advantage_sign = 'zero')::bigint as n_zero_advantage,
        sum(count) filter (where metric = 'trainer_blocked' and advantage_sign != 'zero')::bigint
            as n_trainer_blocked,
        sum(count) filter (where metric = 'bad_negative')::bigint as n_bad_negative,
        max(threshold) filter (where metric = 'bad_negative') as bad_negative_delta,
        sum(sum) filter (where metric = 'abs_prob_diff')
            / nullif(sum(count) filter (where metric = 'abs_prob_diff'), 0) as mismatch_mean,
        max(max) filter (where metric = 'abs_prob_diff') as mismatch_max,
        max(max) filter (where metric = 'prob_diff') as prob_diff_max,
        min(min) filter (where metric = 'prob_diff') as prob_diff_min,
        sum(sum) filter (where metric = 'topk_tv') / nullif(sum(count) filter (where metric = 'topk_tv'), 0)
            as topk_tv_mean,
        max(max) filter (where metric = 'topk_tv') as topk_tv_max,
        sum(sum) filter (where metric = 'topk_kl') / nullif(sum(count) filter (where metric = 'topk_kl'), 0)
            as topk_kl_mean,
        max(max) filter (where metric = 'topk_kl') as topk_kl_max,
        sum(sum) filter (where metric = 'entropy') / nullif(sum(count) filter (where metric = 'entropy'), 0)
            as entropy_mean,
        bool_or(metric = 'trainer_blocked') as has_kept
    from summ
    group by run_id, step
),

rewards as (
    select * from step_rewards
),

final as (
    select
        p.run_id,
        p.step,
        p.n_tokens,
        r.n_samples,
        r.reward_mean,
        r.reward_std,
        r.length_mean,
        p.mismatch_mean,
        p.mismatch_max,
        p.prob_diff_max,
        p.prob_diff_min,
        p.topk_tv_mean,
        p.topk_tv_max,
        p.topk_kl_mean,
        p.topk_kl_max,
        p.entropy_mean,
        coalesce(p.n_positive, 0) as n_positive,
        coalesce(p.n_negative, 0) as n_negative,
        coalesce(p.n_zero_advantage, 0) as n_zero_advantage,
        p.n_bad_negative,
        p.n_bad_negative / nullif(p.n_tokens, 0) as bad_negative_rate,
        p.bad_negative_delta,
        coalesce(p.n_positive, 0) + coalesce(p.n_negative, 0) as n_nonzero_advantage,
        case when p.has_kept then coalesce(p.n_trainer_blocked, 0) end as n_trainer_blocked,
        case when p.has_kept then coalesce(p.n_trainer_blocked, 0) end
            / nullif(coalesce(p.n_positive, 0) + coalesce(p.n_negative, 0), 0) as trainer_blocked_frac
    from per_step as p
    left join rewards as r using (run_id, step)
    order by p.run_id, p.step
)

select * from final
