-- the page "where the mismatch lives" and the report, for mixture-of-experts runs: what each rule blocks among the
-- tokens with A != 0 whose routing fully agrees (agreement 'full') and those where some (layer, slot) choice differs
-- ('disagreement'), per run over the steps [$first_step, $last_step] (null: every step). exact over every token
-- handed to the logger where the run has the summaries' routing dimension (first differing layer -1: full
-- agreement; tokens without engine routing, -2, left out); a run without it (logged before, or with summaries off)
-- from its token rows that carry routing_agreement. $run_ids: the runs, or null for all.
with dim as (
    select run_id, metric, rule, advantage_sign, bucket, count
    from summaries
    where dimension = 'routing' and bucket >= -1 and metric in ('tokens', 'blocked')
        and advantage_sign in ('positive', 'negative')
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

summarised_runs as (
    select distinct run_id from dim where metric = 'tokens'
),

rule_names as (
    select distinct run_id, rule
    from summaries
    where metric = 'blocked' and run_id in (select run_id from summarised_runs)
),

nonzero as (
    select run_id, case when bucket = -1 then 'full agreement' else 'disagreement' end as agreement,
        sum(count)::bigint as n_nonzero_advantage
    from dim
    where metric = 'tokens'
    group by all
),

blocked_counts as (
    select run_id, rule, case when bucket = -1 then 'full agreement' else 'disagreement' end as agreement,
        sum(count)::bigint as n_blocked
    from dim
    where metric = 'blocked'
    group by all
),

from_summaries as (
    select
        n.run_id, r.rule, n.agreement, coalesce(b.n_blocked, 0)::bigint as n_blocked, n.n_nonzero_advantage,
        coalesce(b.n_blocked, 0) / n.n_nonzero_advantage as blocked_frac
    from nonzero as n
    inner join rule_names as r using (run_id)
    left join blocked_counts as b using (run_id, rule, agreement)
),

routed as (
    select run_id, step, rank, sample_id, pos, routing_agreement
    from tokens
    where routing_agreement is not null
        and run_id not in (select run_id from summarised_runs)
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

from_tokens as (
    select
        run_id,
        substr(rule_column, 8) as rule,
        case when routing_agreement = 1 then 'full agreement' else 'disagreement' end as agreement,
        count_if(blocked) as n_blocked,
        count(*) as n_nonzero_advantage,
        count_if(blocked) / count(*) as blocked_frac
    from long
    group by all
),

both_sources as (
    select * from from_summaries
    union all by name
    select * from from_tokens
),

final as (
    select
        run_id, rule, agreement, n_blocked::bigint as n_blocked,
        n_nonzero_advantage::bigint as n_nonzero_advantage, blocked_frac::double as blocked_frac
    from both_sources
)

select * from final order by run_id, rule, agreement desc
