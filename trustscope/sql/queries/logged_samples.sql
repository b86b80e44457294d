-- the responses of run $run_id at step $step whose tokens were logged (a run may log a fraction of them), with how
-- many of their logged tokens with A != 0 (an A = 0 token moves nothing) the trainer's own rule blocked and how
-- many some registered rule would block.
with logged as (
    select
        sample_id,
        count(*) as n_logged,
        count(*) filter (where not kept and advantage <> 0) as n_blocked,
        count(*) filter (where advantage <> 0 and greatest(*columns('^blocks_.*$'))) as n_would_block
    from rule_blocks
    where run_id = $run_id and step = $step
    group by sample_id
),

final as (
    select sample_id, n_logged, n_blocked, n_would_block from logged order by sample_id
)

select * from final
