-- placeholder log-probs judged per turn: tokens whose mu log-prob is exactly 0.0 (probability 1) while the trainer
-- gives the token under $certain (a log-prob): an environment's or tool's tokens with 0.0 padded in for the
-- engine's log-probs, let through by the response mask. no engine computes probability exactly 1 for a token its
-- trainer finds under 0.9 (pi at exactly 1 is left out: a collapsing policy gets there). one row per run with a
-- list per turn (null turn: tokens logged without one). $run_ids: the runs read, or null for all; $first_step: the
-- first step read, or null for all.
with source as (
    select
        run_id, step, rank, sample_id, pos, turn, token_id, mu_logprob, pi_logprob, kept,
        mu_logprob = 0 and pi_logprob < $certain as is_flagged
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_turn as (
    select
        run_id,
        turn,
        count(*) as n_tokens,
        count_if(is_flagged) as n_flagged,
        count_if(is_flagged and kept) as n_flagged_kept,
        max_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn, 'token_id': token_id,
             'mu_logprob': mu_logprob, 'pi_logprob': pi_logprob, 'kept': kept},
            abs(pi_logprob::double - mu_logprob::double), 3
        ) filter (where is_flagged) as examples
    from source
    group by run_id, turn
),

final as (
    select
        run_id,
        sum(n_tokens)::bigint as n_tokens,
        sum(n_flagged)::bigint as n_flagged,
        count(turn)::bigint as n_turns,
        list(
            {'turn': turn, 'n_tokens': n_tokens, 'n_flagged': n_flagged, 'n_flagged_kept': n_flagged_kept,
             'examples': examples}
            order by turn nulls first
        ) as turns
    from per_turn
    group by run_id
)

select * from final order by run_id
