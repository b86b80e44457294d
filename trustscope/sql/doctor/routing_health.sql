-- routing replay health, as the frameworks check it, per run of a mixture-of-experts log: the replace rate (the
-- share of the trainer router's own (layer, slot) choices the replay replaced by the engine's) overall, per MoE
-- layer and per step, and the tokens the engine reported no routing for (fallbacks), whose response's engine
-- experts sit one position off the router's own pick (shifted) or repeat another response's (reused): counts exact
-- from the summaries (every token the logger was handed), example rows from the token rows (the logger keeps the
-- expert lists of every faulty row). $run_ids: the runs read, or null for all; $first_step: the first step read,
-- or null for all.
with sums as (
    select run_id, step, metric, dimension, bucket, count, sum
    from summaries
    where metric in ('routing_agreement', 'routing_replaced', 'routing_fallback', 'routing_shifted',
                     'routing_reused')
        and (dimension is null or dimension = 'layer')
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_run as (
    select
        run_id,
        sum(count) filter (where metric = 'routing_agreement' and dimension is null)::bigint as n_agreement,
        sum(count) filter (where metric = 'routing_replaced' and dimension is null)::bigint as n_replaced,
        sum(sum) filter (where metric = 'routing_replaced' and dimension is null)
            / sum(count) filter (where metric = 'routing_replaced' and dimension is null) as replace_rate,
        coalesce(sum(count) filter (where metric = 'routing_fallback'), 0)::bigint as n_fallback,
        coalesce(sum(count) filter (where metric = 'routing_shifted'), 0)::bigint as n_shifted,
        coalesce(sum(count) filter (where metric = 'routing_reused'), 0)::bigint as n_reused,
        count(*) filter (where metric = 'routing_fallback') > 0 as has_faults
    from sums
    group by run_id
),

by_layer as (
    select run_id, list({'layer': bucket, 'replace_rate': rate} order by bucket) as replace_by_layer
    from (
        select run_id, bucket, sum(sum) / sum(count) as rate
        from sums
        where metric = 'routing_replaced' and dimension = 'layer'
        group by all
    )
    group by run_id
),

by_step as (
    select run_id, max_by({'step': step, 'replace_rate': rate}, rate, 3) as worst_steps,
        list({'step': step, 'replace_rate': rate} order by step) as replace_by_step
    from (
        select run_id, step, sum(sum) / sum(count) as rate
        from sums
        where metric = 'routing_replaced' and dimension is null
        group by all
    )
    group by run_id
),

faulty as (
    select
        run_id,
        list({'step': step, 'sample_id': sample_id, 'pos': pos, 'routing_fault': routing_fault}
             order by step, sample_id, pos) filter (where routing_fault & 1 = 1)[1:5] as fallback_examples,
        list({'step': step, 'sample_id': sample_id, 'pos': pos, 'routing_agreement': routing_agreement,
              'engine_experts': engine_experts, 'router_experts': coalesce(router_experts, trainer_experts)}
             order by step, sample_id, pos) filter (where routing_fault & 6 != 0)[1:5] as alignment_examples,
        count(distinct (step, sample_id)) filter (where routing_fault & 2 = 2)::bigint as n_responses_shifted,
        count(distinct (step, sample_id)) filter (where routing_fault & 4 = 4)::bigint as n_responses_reused
    from tokens
    where routing_fault is not null and routing_fault != 0
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
    group by run_id
),

final as (
    select p.*, l.replace_by_layer, s.worst_steps, s.replace_by_step, f.fallback_examples, f.alignment_examples,
        coalesce(f.n_responses_shifted, 0) as n_responses_shifted,
        coalesce(f.n_responses_reused, 0) as n_responses_reused
    from per_run as p
    left join by_layer as l using (run_id)
    left join by_step as s using (run_id)
    left join faulty as f using (run_id)
)

select * from final order by run_id
