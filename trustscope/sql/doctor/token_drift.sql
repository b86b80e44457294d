-- re-tokenization drift: the token id the rollout engine sampled (engine_token_id, where the integration logs it)
-- against the id the trainer scored (token_id), per run, with the count per turn and the first drifting tokens
-- (a re-rendered chat history re-tokenized differently from what the model sampled). $run_ids: the runs read, or
-- null for all; $first_step: the first step read, or null for all.
with source as (
    select run_id, step, sample_id, pos, turn, token_id, engine_token_id,
        engine_token_id is not null and engine_token_id != token_id as differs
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_turn as (
    select run_id, turn, count(engine_token_id) as n_logged, count_if(differs) as n_differ
    from source
    group by all
),

per_run as (
    select
        run_id,
        count(*) as n_tokens,
        count(engine_token_id) as n_logged,
        count_if(differs) as n_differ,
        count(distinct (step, sample_id)) filter (where differs) as n_responses_differ,
        min_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn, 'token_id': token_id,
             'engine_token_id': engine_token_id},
            step * 1000000 + pos, 3
        ) filter (where differs) as examples
    from source
    group by run_id
),

turns as (
    select run_id, list({'turn': turn, 'n_logged': n_logged, 'n_differ': n_differ} order by turn nulls first) as turns
    from per_turn
    group by run_id
),

final as (
    select p.*, t.turns
    from per_run as p
    left join turns as t using (run_id)
)

select * from final order by run_id
