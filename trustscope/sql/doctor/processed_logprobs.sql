-- the engine's log-prob of each sampled token against the trainer's (pi_old where logged, else pi), per run: the
-- mean and spread of log mu - log ref, and the slope of mu's top-k log-probs on pi's at the same ids: the ratio of
-- their spreads within each row, pooled (1 when both are one distribution, 1 / temperature when mu is after a
-- temperature and pi is raw, whatever the normaliser; the spread ratio is half as shrunk by noise in pi as a
-- least-squares slope), over the entries above $floor. $run_ids: the runs read, or null for all; $first_step: the
-- first step read, or null for all.
with source as (
    select
        run_id, step, sample_id, pos, mu_logprob,
        coalesce(old_logprob, pi_logprob) as ref_logprob,
        old_logprob is not null as ref_is_old,
        -- entries at or below $floor are stand-ins (an engine's floor for ids outside the top-p nucleus): left out.
        list_var_pop(list_filter(mu_topk_logprobs, lambda x, i: x > $floor and pi_topk_logprobs[i] > $floor))
            as mu_topk_var,
        list_var_pop(list_filter(pi_topk_logprobs, lambda x, i: x > $floor and mu_topk_logprobs[i] > $floor))
            as pi_topk_var
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_row as (
    select *, mu_logprob::double - ref_logprob::double as log_gap
    from source
),

final as (
    select
        run_id,
        count(*) as n_tokens,
        count_if(ref_is_old) as n_ref_old,
        avg(log_gap) as mean_log_gap,
        stddev_samp(log_gap) as sd_log_gap,
        count_if(pi_topk_var > 0) as n_topk_rows,
        sqrt(sum(mu_topk_var) filter (where pi_topk_var > 0) / sum(pi_topk_var) filter (where pi_topk_var > 0))
            as topk_slope,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'mu_logprob': mu_logprob,
                'ref_logprob': ref_logprob}, log_gap, 3) as examples
    from per_row
    group by run_id
)

select * from final order by run_id
