-- mu and pi of every token (as probabilities) beside pi one position later (pi_later) and one earlier (pi_earlier)
-- inside the same response, or with `by_turn` inside the same turn of it (null where that position is not logged):
-- what the doctor's alignment and turn_alignment checks compare. `run_ids`: the runs read, or null for all;
-- `first_step`: the first step read, or null for all.
create or replace macro pi_shifted(run_ids, first_step, by_turn) as table
    with source as (
        select
            run_id, step, rank, sample_id, pos, turn,
            case when by_turn then turn end as segment,
            exp(mu_logprob::double) as mu_prob,
            exp(pi_logprob::double) as pi_prob
        from tokens
        where (run_ids::varchar[] is null or list_contains(run_ids::varchar[], run_id))
            and (first_step::bigint is null or step >= first_step::bigint)
    ),

    neighbours as (
        select
            *,
            lead(pi_prob) over w as pi_next,
            lead(pos) over w as pos_next,
            lag(pi_prob) over w as pi_prev,
            lag(pos) over w as pos_prev
        from source
        window w as (partition by run_id, step, rank, sample_id, segment order by pos)
    )

    select
        run_id, step, rank, sample_id, pos, turn, mu_prob, pi_prob,
        case when pos_next = pos + 1 then pi_next end as pi_later,
        case when pos_prev = pos - 1 then pi_prev end as pi_earlier
    from neighbours;
