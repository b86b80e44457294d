-- the token rows behind verl's sequence figures at one step ($run_id, $step): each sequence (sample_id, and
-- update_index where a response was trained by several updates of the step) with its
-- row count, verl's per-sequence log-perplexity difference (mean log mu - mean log pi_train, whose mean, max and
-- min are rollout_corr/log_ppl_diff*), its summed log ratio (whose squared exponential chi2_seq averages), its
-- largest |log pi_train - log mu| and its rejected rows, the $limit largest |log_ppl_diff| first. training side
-- and rows as the verl_rollout_corr view.
with step_rows as (
    select
        sample_id,
        update_index,
        mu_logprob::double as rollout_logprob,
        coalesce(old_logprob, pi_logprob)::double as training_logprob,
        rollout_rejected
    from tokens
    where run_id = $run_id and step = $step
),

per_sequence as (
    select
        sample_id,
        update_index,
        count(*) as n_tokens,
        avg(rollout_logprob) - avg(training_logprob) as log_ppl_diff,
        sum(training_logprob - rollout_logprob) as log_ratio_sum,
        max(abs(training_logprob - rollout_logprob)) as max_abs_log_ratio,
        count(*) filter (where rollout_rejected) as n_rejected
    from step_rows
    group by sample_id, update_index
),

final as (
    select *
    from per_sequence
    order by abs(log_ppl_diff) desc, sample_id
    limit $limit
)

select * from final
