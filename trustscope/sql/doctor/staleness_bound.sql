-- how stale the logged tokens are: staleness = step - policy_version (weight updates the sampling engine was behind
-- the trainer), as counts per staleness value, and the stalest tokens, per run; the judge holds them to the run's
-- declared bound (run.json's max_staleness). $run_ids: the runs read, or null for all; $first_step: the first step
-- read, or null for all.
with source as (
    select run_id, step, sample_id, pos, turn, policy_version, staleness
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

counts as (
    select run_id, staleness, count(*) as n
    from source
    where staleness is not null
    group by all
),

per_run as (
    select
        run_id,
        count(*) as n_tokens,
        count(staleness) as n_versioned,
        max(staleness) as max_staleness,
        max_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn, 'policy_version': policy_version,
             'staleness': staleness},
            staleness, 3
        ) filter (where staleness is not null) as examples
    from source
    group by run_id
),

by_value as (
    select run_id, list({'staleness': staleness, 'n': n} order by staleness) as by_staleness
    from counts
    group by run_id
),

final as (
    select p.*, v.by_staleness
    from per_run as p
    left join by_value as v using (run_id)
)

select * from final order by run_id
