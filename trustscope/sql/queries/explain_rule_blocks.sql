-- trustscope explain, for runs whose token rows carry no blocked_rules bits (imports, older logs): the logged
-- tokens of every response grouped by which causes touch them (explain_tokens), with the tokens with a non-zero
-- advantage and, per rule (blocks_<rule> of rule_blocks, at the parameters the connection binds), how many of those
-- the rule blocks (the summaries' `blocked` count the same tokens). one row per (run, step, rank, response,
-- pattern). slower than explain_patterns: rule_blocks evaluates every rule, the sequence rules' windows included.
-- $run_ids: the runs, or null for all; $first_step: the first step read, or null; the rest are the indicators'
-- thresholds.
with flagged as (
    select *
    from explain_tokens($run_ids, $first_step, null, $shift_factor, $shift_floor, $min_r2, $temperature_tolerance,
                        $truncation_offset)
),

blocks as (
    select run_id, step, rank, sample_id, pos, columns('^blocks_')
    from rule_blocks
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

joined as (
    select f.*, b.* exclude (run_id, step, rank, sample_id, pos)
    from flagged as f
    join blocks as b using (run_id, step, rank, sample_id, pos)
),

final as (
    select
        run_id, step, rank, sample_id, stale, routing, drift, shift, temperature, truncation,
        count_if(advantage != 0) as n_signed,
        sum(columns('^blocks_')::integer * (advantage != 0)::integer)::bigint
    from joined
    group by all
)

select * from final order by run_id, step, rank, sample_id
