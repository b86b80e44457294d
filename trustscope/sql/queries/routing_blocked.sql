-- the page "where the mismatch lives" and the report, for mixture-of-experts runs: what each rule blocks among the
-- tokens with A != 0 whose routing fully agrees (agreement 'full') and those where some (layer, slot) choice differs
-- ('disagreement'), per run over the steps [$first_step, $last_step] (null: every step), on the token rows that
-- carry routing_agreement. $run_ids: the runs, or null for all.
with routed as (
    select run_id, step, rank, sample_id, pos, routing_agreement
    from tokens
    where routing_agreement is not null
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

blocks as (
    select b.run_id, columns('^blocks_.*$'), r.routing_agreement
    from rule_blocks as b
    inner join routed as r using (run_id, step, rank, sample_id, pos)
    where b.advantage <> 0
),

long as (
    unpivot blocks
    on columns('^blocks_.*$')
    into name rule_column value blocked
),

final as (
    select
        run_id,
        substr(rule_column, 8) as rule,
        case when routing_agreement = 1 then 'full agreement' else 'disagreement' end as agreement,
        count_if(blocked) as n_blocked,
        count(*) as n_nonzero_advantage,
        count_if(blocked) / count(*) as blocked_frac
    from long
    group by all
)

select * from final order by run_id, rule, agreement desc
