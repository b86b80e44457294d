-- slime's own mismatch figures, train_rollout_logprob_abs_diff, tis, tis_clipfrac and tis_abs, one row per (run,
-- step, reducer), from slime/backends/megatron_utils/loss.py (policy_loss_function: |log_probs - rollout_log_probs|;
-- vanilla_tis_function: tis = exp(log_probs - rollout_log_probs), tis_clipfrac = clamp(tis, tis_clip_low, tis_clip)
-- != tis, tis_abs = |tis - 1|). training side: old_logprob (slime's batch log_probs, the recompute before the
-- update), pi_logprob where a row has none; rollout side: mu_logprob; rows: every logged row (slime's loss_masks).
-- reducer 'per_rollout_mean' is slime's default (cp_utils.py get_sum_of_sample_mean over the step's rollouts: each
-- sequence's token mean, summed, divided by the sequence count); 'per_token' is --calculate-per-token-loss (a
-- token mean over the step). the clip bounds are the analysis parameters slime_tis_clip and slime_tis_clip_low.
-- declared in trustscope/framework_metrics.py.
with source as (
    select
        run_id,
        step,
        sample_id,
        coalesce(update_index, -1) as update_key,
        coalesce(old_logprob, pi_logprob)::double - mu_logprob::double as log_ratio
    from tokens
),

per_token as (
    select
        run_id,
        step,
        sample_id,
        update_key,
        abs(log_ratio) as abs_diff,
        exp(log_ratio) as tis,
        (least(greatest(exp(log_ratio), analysis_param('slime_tis_clip_low')::double),
               analysis_param('slime_tis_clip')::double) != exp(log_ratio))::double as tis_clipfrac,
        abs(exp(log_ratio) - 1.0) as tis_abs
    from source
),

per_sequence as (
    select
        run_id,
        step,
        sample_id,
        update_key,
        count(*) as n_tokens,
        avg(abs_diff) as abs_diff,
        avg(tis) as tis,
        avg(tis_clipfrac) as tis_clipfrac,
        avg(tis_abs) as tis_abs
    from per_token
    group by run_id, step, sample_id, update_key
),

per_rollout_mean as (
    select
        run_id,
        step,
        'per_rollout_mean' as reducer,
        sum(n_tokens)::bigint as n_tokens,
        count(*) as n_sequences,
        avg(abs_diff) as abs_diff,
        avg(tis) as tis,
        avg(tis_clipfrac) as tis_clipfrac,
        avg(tis_abs) as tis_abs
    from per_sequence
    group by run_id, step
),

per_token_mean as (
    select
        run_id,
        step,
        'per_token' as reducer,
        count(*) as n_tokens,
        count(distinct [sample_id, update_key]) as n_sequences,
        avg(abs_diff) as abs_diff,
        avg(tis) as tis,
        avg(tis_clipfrac) as tis_clipfrac,
        avg(tis_abs) as tis_abs
    from per_token
    group by run_id, step
),

both_reducers as (
    select * from per_rollout_mean
    union all
    select * from per_token_mean
),

final as (
    select
        run_id,
        step,
        reducer,
        n_tokens,
        n_sequences,
        abs_diff as train_rollout_logprob_abs_diff,
        tis,
        tis_clipfrac,
        tis_abs
    from both_reducers
    order by run_id, step, reducer
)

select * from final
