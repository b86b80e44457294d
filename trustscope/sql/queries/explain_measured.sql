-- trustscope explain's measured attribution: per run and step, the integrated trainer's recompute of the
-- mismatch with each known cause removed (train --explain-tokens, trustscope/train/attribution.py), as it logged
-- it into the step scalars explain/measured/<name>: the shares by cause, unexplained, mismatch and tokens.
-- $run_ids: the runs, or null for all; $first_step: the first step read, or null.
with source as (
    select run_id, step, name, value
    from steps
    where name like 'explain/measured/%'
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

final as (
    select run_id, step, substr(name, length('explain/measured/') + 1) as name, avg(value) as value
    from source
    group by all
)

select * from final order by run_id, step, name
