-- every token of every response with its metrics, text and the counterfactual rule flags: the token explorer's
-- source (filter it on run_id, step and sample_id).
with metrics as (
    select * from token_metrics
),

blocks as (
    select run_id, step, sample_id, pos, columns('^blocks_.*$')
    from rule_blocks
),

final as (
    select metrics.*, blocks.* exclude (run_id, step, sample_id, pos)
    from metrics
    join blocks using (run_id, step, sample_id, pos)
)

select * from final
