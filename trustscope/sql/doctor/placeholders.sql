-- tokens whose mu or pi log-prob is a placeholder (exactly 0, or at or below $floor: an -inf stand-in) and whose
-- divergence is huge (|pi - mu| > $huge_tv or |log pi - log mu| > $huge_log_ratio), per run: padding or unscored
-- positions that the response mask let through. $run_ids: the runs read, or null for all; $first_step: the first
-- step read, or null for all.
with source as (
    select
        run_id, step, rank, sample_id, pos, token_id, mu_logprob, pi_logprob, kept,
        max(pos) over (partition by run_id, step, rank, sample_id) as last_pos
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

marked as (
    select
        *,
        mu_logprob = 0 or mu_logprob <= $floor as mu_placeholder,
        pi_logprob = 0 or pi_logprob <= $floor as pi_placeholder,
        binary_tv(mu_logprob, pi_logprob) > $huge_tv
            or abs(pi_logprob::double - mu_logprob::double) > $huge_log_ratio as huge
    from source
),

flagged as (
    select *, (mu_placeholder or pi_placeholder) and huge as is_flagged
    from marked
),

final as (
    select
        run_id,
        count(*) as n_tokens,
        count_if(is_flagged) as n_flagged,
        count_if(is_flagged and kept) as n_flagged_kept,
        count_if(is_flagged and pos = last_pos) as n_flagged_at_end,
        count_if(is_flagged and mu_placeholder) as n_mu_placeholder,
        count_if(is_flagged and pi_placeholder) as n_pi_placeholder,
        max_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'token_id': token_id, 'mu_logprob': mu_logprob,
             'pi_logprob': pi_logprob, 'kept': kept, 'last_pos': last_pos},
            abs(pi_logprob::double - mu_logprob::double), 3
        ) filter (where is_flagged) as examples
    from flagged
    group by run_id
)

select * from final order by run_id
