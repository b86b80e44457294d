-- alignment judged per turn: mu against pi at the logged alignment and shifted one position either way inside each
-- turn of each response (a shift that starts at a turn boundary, as when a separator is dropped at every
-- assistant-to-tool boundary, hides in a whole-response average). one row per run with a list per turn (null turn:
-- tokens logged without one; the table macro pi_shifted). $run_ids: the runs read, or null for all; $first_step:
-- the first step read, or null.
with shifted as (
    select *, min(pos) over (partition by run_id, step, rank, sample_id, turn) as turn_start
    from pi_shifted($run_ids, $first_step, true)
),

per_turn as (
    select
        run_id,
        turn,
        count(*) as n_tokens,
        count(pi_later) as n_pairs,
        avg(abs(pi_prob - mu_prob)) as diff_logged,
        avg(abs(pi_later - mu_prob)) as diff_pi_later,
        avg(abs(pi_earlier - mu_prob)) as diff_pi_earlier,
        max_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn, 'turn_start': turn_start,
             'mu_prob': mu_prob, 'pi_prob': pi_prob, 'pi_prob_next_pos': pi_later,
             'pi_prob_previous_pos': pi_earlier},
            abs(pi_prob - mu_prob), 3
        ) as examples
    from shifted
    group by run_id, turn
),

final as (
    select
        run_id,
        sum(n_tokens)::bigint as n_tokens,
        count(turn)::bigint as n_turns,
        list(
            {'turn': turn, 'n_tokens': n_tokens, 'n_pairs': n_pairs, 'diff_logged': diff_logged,
             'diff_pi_later': diff_pi_later, 'diff_pi_earlier': diff_pi_earlier, 'examples': examples}
            order by turn nulls first
        ) as turns
    from per_turn
    group by run_id
)

select * from final order by run_id
