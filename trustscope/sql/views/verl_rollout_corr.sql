-- verl's own mismatch figures, one row per (run, step), named as verl logs them: rollout_corr/* of
-- verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics (perplexities, kl, k3_kl, chi-squared per token
-- and per sequence) and compute_rollout_rejection_mask (rejected shares per token and per sequence, from the
-- rollout_rejected column: null where the rows do not say), and training/rollout_* of verl/utils/debug/metrics.py
-- calculate_debug_metrics. training side: old_logprob (verl's old_log_probs), pi_logprob where a row has none
-- (training_side says which); rollout side: mu_logprob. rows: every logged row of the step (verl's response_mask
-- before rejection sampling). a sequence is a sample_id of the step, once per update that trained it (update_index:
-- a response trained by several updates of the step has its rows once per update). declared in
-- trustscope/framework_metrics.py.
with source as (
    select
        run_id,
        step,
        sample_id,
        coalesce(update_index, -1) as update_key,
        mu_logprob::double as rollout_logprob,
        coalesce(old_logprob, pi_logprob)::double as training_logprob,
        old_logprob is not null as has_old,
        rollout_rejected
    from tokens
),

per_token as (
    select
        *,
        training_logprob - rollout_logprob as log_ratio,
        abs(exp(training_logprob) - exp(rollout_logprob)) as probs_diff
    from source
),

per_sequence as (
    select
        run_id,
        step,
        sample_id,
        avg(training_logprob) as mean_training,
        avg(rollout_logprob) as mean_rollout,
        sum(log_ratio) as log_ratio_sum,
        bool_or(rollout_rejected) as any_rejected
    from per_token
    group by run_id, step, sample_id, update_key
),

sequence_stats as (
    select
        run_id,
        step,
        count(*) as n_sequences,
        avg(exp(-mean_training)) as training_ppl,
        avg(-mean_training) as training_log_ppl,
        avg(exp(-mean_rollout)) as rollout_ppl,
        avg(-mean_rollout) as rollout_log_ppl,
        avg(mean_rollout - mean_training) as log_ppl_diff,
        avg(abs(mean_rollout - mean_training)) as log_ppl_abs_diff,
        max(mean_rollout - mean_training) as log_ppl_diff_max,
        min(mean_rollout - mean_training) as log_ppl_diff_min,
        avg(exp(mean_rollout - mean_training)) as ppl_ratio,
        avg(exp(2.0 * least(greatest(log_ratio_sum, -20.0), 20.0))) - 1.0 as chi2_seq,
        avg(any_rejected::double) as rs_seq_masked_fraction
    from per_sequence
    group by run_id, step
),

token_stats as (
    select
        run_id,
        step,
        count(*) as n_tokens,
        case when bool_and(has_old) then 'old_logprob' when bool_or(has_old) then 'mixed' else 'pi_logprob' end
            as training_side,
        avg(rollout_logprob - training_logprob) as kl,
        avg(exp(log_ratio) - log_ratio - 1.0) as k3_kl,
        avg(exp(2.0 * least(greatest(log_ratio, -20.0), 20.0))) - 1.0 as chi2_token,
        avg(rollout_rejected::double) as rs_masked_fraction,
        max(probs_diff) as probs_diff_max,
        avg(probs_diff) as probs_diff_mean,
        stddev_samp(probs_diff) as probs_diff_std,
        corr(exp(training_logprob), exp(rollout_logprob)) as probs_pearson_corr
    from per_token
    group by run_id, step
),

final as (
    select
        t.run_id,
        t.step,
        t.n_tokens,
        s.n_sequences,
        t.training_side,
        s.training_ppl as "rollout_corr/training_ppl",
        s.training_log_ppl as "rollout_corr/training_log_ppl",
        t.kl as "rollout_corr/kl",
        t.k3_kl as "rollout_corr/k3_kl",
        s.rollout_ppl as "rollout_corr/rollout_ppl",
        s.rollout_log_ppl as "rollout_corr/rollout_log_ppl",
        s.log_ppl_diff as "rollout_corr/log_ppl_diff",
        s.log_ppl_abs_diff as "rollout_corr/log_ppl_abs_diff",
        s.log_ppl_diff_max as "rollout_corr/log_ppl_diff_max",
        s.log_ppl_diff_min as "rollout_corr/log_ppl_diff_min",
        s.ppl_ratio as "rollout_corr/ppl_ratio",
        t.chi2_token as "rollout_corr/chi2_token",
        s.chi2_seq as "rollout_corr/chi2_seq",
        t.rs_masked_fraction as "rollout_corr/rollout_rs_masked_fraction",
        s.rs_seq_masked_fraction as "rollout_corr/rollout_rs_seq_masked_fraction",
        1.0 as "training/rollout_probs_diff_valid",
        t.probs_diff_max as "training/rollout_probs_diff_max",
        t.probs_diff_mean as "training/rollout_probs_diff_mean",
        t.probs_diff_std as "training/rollout_probs_diff_std",
        t.probs_pearson_corr as "training/rollout_actor_probs_pearson_corr"
    from token_stats as t
    inner join sequence_stats as s using (run_id, step)
    order by t.run_id, t.step
)

select * from final
