-- the page "where the mismatch lives" and the report, for mixture-of-experts runs: |log pi/mu| by routing agreement,
-- per run and split over the steps [$first_step, $last_step] (null: every step). split 'agreement': bucket 0 the
-- tokens whose every (layer, slot) choice agrees, 1 the rest; 'first_layer': the first MoE layer where the engine's
-- and the trainer's experts differ (-1: none); 'position': the position bucket, with the disagreeing tokens' count
-- and mean apart. abs_share: the split's share of the run's total |log pi/mu|. exact over every token handed to the
-- logger where the run has the summaries' routing rows (metrics routing_abs_log_ratio by dimension routing,
-- routing_abs_log_ratio_agree / _differ by position); a run without them (logged before, or with summaries off)
-- from its token rows carrying both sides' experts, the layers and top-k from run.json's routing_shape.
-- $run_ids: the runs, or null for all.
with picked as (
    select run_id, metric, dimension, bucket, count, sum
    from summaries
    where metric in ('routing_abs_log_ratio', 'routing_abs_log_ratio_agree', 'routing_abs_log_ratio_differ')
        and count > 0
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

summarised_runs as (
    select distinct run_id from picked where metric = 'routing_abs_log_ratio'
),

first_layers as (
    select run_id, bucket, sum(count)::bigint as n, sum(sum) as total
    from picked
    where metric = 'routing_abs_log_ratio' and dimension = 'routing' and bucket >= -1
    group by all
),

positions as (
    select
        run_id,
        bucket,
        sum(count)::bigint as n,
        sum(count) filter (where metric = 'routing_abs_log_ratio_differ')::bigint as n_differ,
        sum(sum) as total,
        sum(sum) filter (where metric = 'routing_abs_log_ratio_agree') as total_agree,
        sum(count) filter (where metric = 'routing_abs_log_ratio_agree') as n_agree,
        sum(sum) filter (where metric = 'routing_abs_log_ratio_differ') as total_differ
    from picked
    where metric in ('routing_abs_log_ratio_agree', 'routing_abs_log_ratio_differ') and dimension = 'position'
    group by all
),

from_summaries as (
    select
        run_id, 'agreement' as split, (bucket >= 0)::bigint as bucket, sum(n)::bigint as n_tokens,
        coalesce(sum(n) filter (where bucket >= 0), 0)::bigint as n_disagree, sum(total) / sum(n) as mean_abs,
        sum(total) filter (where bucket = -1) / sum(n) filter (where bucket = -1) as mean_abs_full,
        sum(total) filter (where bucket >= 0) / sum(n) filter (where bucket >= 0) as mean_abs_disagree,
        sum(total) as abs_total
    from first_layers
    group by run_id, (bucket >= 0)
    union all
    select
        run_id, 'first_layer', bucket, n, case when bucket >= 0 then n else 0 end, total / n,
        case when bucket = -1 then total / n end, case when bucket >= 0 then total / n end, total
    from first_layers
    union all
    select
        run_id, 'position', bucket, n, coalesce(n_differ, 0), total / n, total_agree / n_agree,
        total_differ / n_differ, total
    from positions
),

shapes as (
    select
        run_id,
        json_extract(manifest, '$.routing_shape[0]')::integer as n_layers,
        json_extract(manifest, '$.routing_shape[1]')::integer as top_k
    from runs
    where json_extract(manifest, '$.routing_shape') is not null
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and run_id not in (select run_id from summarised_runs)
),

routed as (
    select
        t.run_id, t.pos, t.routing_agreement,
        abs(t.pi_logprob::double - t.mu_logprob::double) as abs_log_ratio,
        list_filter(range(s.n_layers), lambda l: not list_has_all(
            t.trainer_experts[l * s.top_k + 1: (l + 1) * s.top_k],
            t.engine_experts[l * s.top_k + 1: (l + 1) * s.top_k])) as layers_differing
    from tokens as t
    inner join shapes as s using (run_id)
    where t.routing_agreement is not null and t.engine_experts is not null and t.trainer_experts is not null
        and ($first_step::bigint is null or t.step >= $first_step::bigint)
        and ($last_step::bigint is null or t.step <= $last_step::bigint)
),

splits as (
    select run_id, 'agreement' as split, (routing_agreement < 1)::bigint as bucket, routing_agreement,
        abs_log_ratio
    from routed
    union all
    select run_id, 'first_layer', coalesce(layers_differing[1], -1)::bigint, routing_agreement, abs_log_ratio
    from routed
    union all
    select run_id, 'position', position_bucket(pos), routing_agreement, abs_log_ratio
    from routed
),

from_tokens as (
    select
        run_id,
        split,
        bucket,
        count(*) as n_tokens,
        count_if(routing_agreement < 1) as n_disagree,
        avg(abs_log_ratio) as mean_abs,
        avg(abs_log_ratio) filter (where routing_agreement = 1) as mean_abs_full,
        avg(abs_log_ratio) filter (where routing_agreement < 1) as mean_abs_disagree,
        sum(abs_log_ratio) as abs_total
    from splits
    group by all
),

both_sources as (
    select * from from_summaries
    union all by name
    select * from from_tokens
),

totals as (
    select run_id, sum(abs_total) as total_abs
    from both_sources
    where split = 'first_layer'
    group by run_id
),

final as (
    select
        s.run_id,
        s.split,
        s.bucket,
        case
            when s.split = 'agreement' then (case when s.bucket = 0 then 'full agreement' else 'disagreement' end)
            when s.split = 'first_layer' then (case when s.bucket < 0 then 'none' else 'layer ' || s.bucket end)
            else position_bucket_label(s.bucket)
        end as label,
        s.n_tokens::bigint as n_tokens,
        s.n_disagree::bigint as n_disagree,
        s.mean_abs,
        s.mean_abs_full,
        s.mean_abs_disagree,
        s.abs_total / nullif(t.total_abs, 0) as abs_share
    from both_sources as s
    inner join totals as t using (run_id)
)

select * from final order by run_id, split, bucket
