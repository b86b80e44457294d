-- TRL's own mismatch figures, sampling/sampling_logp_difference/{mean,max} and
-- sampling/importance_sampling_ratio/{min,mean,max}, one row per (run, step, vllm_importance_sampling_mode), from
-- trl/trainer/grpo_trainer.py GRPOTrainer._generate_and_score_completions (TRL 1.16): |old_per_token_logps -
-- sampling_per_token_logps| over completion_mask * tool_mask (mean and max); the vLLM importance-sampling ratio
-- exp(old - sampling) per token (token_* modes) or exp of its sum per sequence (sequence_* modes), clamped to
-- [clip_min, clip_max] (*_truncate) or zeroed outside them (*_mask), its min, mean and max over the masked tokens
-- (token modes) or over the sequences (sequence modes). training side: old_logprob (TRL's old_per_token_logps),
-- pi_logprob where a row has none; rollout side: mu_logprob (vLLM's sampling_per_token_logps); rows: every logged
-- row (the tokens TRL's loss covers). the bounds are the analysis parameters trl_is_clip_min (0: none, TRL's
-- default None) and trl_is_clip_max. declared in trustscope/framework_metrics.py.
with bounds as (
    select
        analysis_param('trl_is_clip_min')::double as clip_min,
        analysis_param('trl_is_clip_max')::double as clip_max
),

source as (
    select
        run_id,
        step,
        sample_id,
        coalesce(update_index, -1) as update_key,
        coalesce(old_logprob, pi_logprob)::double - mu_logprob::double as log_diff
    from tokens
),

token_ratios as (
    select
        s.run_id,
        s.step,
        least(greatest(exp(s.log_diff), b.clip_min), b.clip_max) as truncated,
        case when exp(s.log_diff) < b.clip_min or exp(s.log_diff) > b.clip_max then 0.0 else exp(s.log_diff) end
            as masked
    from source as s
    cross join bounds as b
),

sequence_ratios as (
    select
        q.run_id,
        q.step,
        least(greatest(exp(q.log_ratio), b.clip_min), b.clip_max) as truncated,
        case when exp(q.log_ratio) < b.clip_min or exp(q.log_ratio) > b.clip_max then 0.0 else exp(q.log_ratio) end
            as masked
    from (
        select run_id, step, sum(log_diff) as log_ratio
        from source
        group by run_id, step, sample_id, update_key
    ) as q
    cross join bounds as b
),

ratio_stats as (
    select run_id, step, 'token_truncate' as mode, min(truncated) as ratio_min, avg(truncated) as ratio_mean,
        max(truncated) as ratio_max
    from token_ratios
    group by run_id, step
    union all
    select run_id, step, 'token_mask', min(masked), avg(masked), max(masked)
    from token_ratios
    group by run_id, step
    union all
    select run_id, step, 'sequence_truncate', min(truncated), avg(truncated), max(truncated)
    from sequence_ratios
    group by run_id, step
    union all
    select run_id, step, 'sequence_mask', min(masked), avg(masked), max(masked)
    from sequence_ratios
    group by run_id, step
),

difference_stats as (
    select
        run_id,
        step,
        count(*) as n_tokens,
        count(distinct [sample_id, update_key]) as n_sequences,
        avg(abs(log_diff)) as diff_mean,
        max(abs(log_diff)) as diff_max
    from source
    group by run_id, step
),

final as (
    select
        d.run_id,
        d.step,
        r.mode as vllm_importance_sampling_mode,
        d.n_tokens,
        d.n_sequences,
        d.diff_mean as "sampling/sampling_logp_difference/mean",
        d.diff_max as "sampling/sampling_logp_difference/max",
        r.ratio_min as "sampling/importance_sampling_ratio/min",
        r.ratio_mean as "sampling/importance_sampling_ratio/mean",
        r.ratio_max as "sampling/importance_sampling_ratio/max"
    from difference_stats as d
    inner join ratio_stats as r using (run_id, step)
    order by d.run_id, d.step, r.mode
)

select * from final
