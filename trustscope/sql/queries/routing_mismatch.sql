-- the page "where the mismatch lives" and the report, for mixture-of-experts runs: |log pi/mu| by routing agreement,
-- per run and split over the steps [$first_step, $last_step] (null: every step), on the token rows that carry both
-- sides' experts (the rows token_fraction kept). split 'agreement': bucket 0 the tokens whose every (layer, slot)
-- choice agrees, 1 the rest; 'first_layer': the first MoE layer where the engine's and the trainer's experts differ
-- (-1: none); 'position': the position bucket, with the disagreeing tokens' count and mean apart. abs_share: the
-- split's share of the run's total |log pi/mu|. the layers and top-k come from run.json's routing_shape.
-- $run_ids: the runs, or null for all.
with shapes as (
    select
        run_id,
        json_extract(manifest, '$.routing_shape[0]')::integer as n_layers,
        json_extract(manifest, '$.routing_shape[1]')::integer as top_k
    from runs
    where json_extract(manifest, '$.routing_shape') is not null
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
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

totals as (
    select run_id, sum(abs_log_ratio) as total_abs
    from routed
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
        count(*) as n_tokens,
        count_if(s.routing_agreement < 1) as n_disagree,
        avg(s.abs_log_ratio) as mean_abs,
        avg(s.abs_log_ratio) filter (where s.routing_agreement = 1) as mean_abs_full,
        avg(s.abs_log_ratio) filter (where s.routing_agreement < 1) as mean_abs_disagree,
        sum(s.abs_log_ratio) / nullif(any_value(t.total_abs), 0) as abs_share
    from splits as s
    inner join totals as t using (run_id)
    group by s.run_id, s.split, s.bucket
)

select * from final order by run_id, split, bucket
