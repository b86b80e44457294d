-- where the token explorer opens on run $run_id: the latest step holding a token the trainer's own rule blocked,
-- else the latest step holding a token some rule would block, else the latest step; in that step the response
-- with the most such tokens (counted over A != 0: an A = 0 token moves nothing), then the longest.
with per_sample as (
    select
        step,
        sample_id,
        count(*) filter (where not kept and advantage <> 0) as n_blocked,
        count(*) filter (where advantage <> 0 and greatest(*columns('^blocks_.*$'))) as n_would_block,
        count(*) as n_logged
    from rule_blocks
    where run_id = $run_id
    group by step, sample_id
),

final as (
    select step, sample_id, n_blocked, n_would_block, n_logged
    from per_sample
    order by
        (n_blocked > 0) desc, (n_would_block > 0) desc, step desc, n_blocked desc, n_would_block desc,
        n_logged desc, sample_id
    limit 1
)

select * from final
