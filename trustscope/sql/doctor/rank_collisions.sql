-- (step, sample_id) keys that more than one rank wrote, in the tokens and the samples tables, per run. the schema
-- keeps sample_id unique within a step over all ranks; ranks that each count from 0 collide. $run_ids: the runs
-- read, or null for all; $first_step: the first step read, or null for all.
with keys as (
    select distinct 'tokens' as table_name, run_id, step, sample_id, rank
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
    union all
    select distinct 'samples' as table_name, run_id, step, sample_id, rank
    from samples
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

collisions as (
    select table_name, run_id, step, sample_id, list(rank order by rank) as ranks
    from keys
    group by table_name, run_id, step, sample_id
    having count(*) > 1
),

ranks as (
    select run_id, count(distinct rank) as n_ranks
    from keys
    group by run_id
),

final as (
    select
        r.run_id,
        r.n_ranks,
        count(c.sample_id) filter (where c.table_name = 'tokens') as n_token_collisions,
        count(c.sample_id) filter (where c.table_name = 'samples') as n_sample_collisions,
        max_by({'table': c.table_name, 'step': c.step, 'sample_id': c.sample_id, 'ranks': c.ranks},
               -c.step, 3) filter (where c.sample_id is not null) as examples
    from ranks as r
    left join collisions as c on c.run_id = r.run_id
    group by r.run_id, r.n_ranks
)

select * from final order by run_id
