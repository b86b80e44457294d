-- the page "where the mismatch lives" and the report, for mixture-of-experts runs (run.json's routing_shape): per
-- run over the steps [$first_step, $last_step] (null: every step), the token rows carrying the engine's routed
-- experts, the trainer's, and both. a run with the engine's side alone (an import of a framework that keeps the
-- rollout's experts for replay, not the trainer router's own) has no agreement to split by. $run_ids: the runs, or
-- null for all.
with routed_runs as (
    select run_id
    from runs
    where json_extract(manifest, '$.routing_shape') is not null
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
),

final as (
    select
        t.run_id,
        count(t.engine_experts)::bigint as n_engine,
        count(t.trainer_experts)::bigint as n_trainer,
        count(*) filter (where t.engine_experts is not null and t.trainer_experts is not null)::bigint as n_both
    from tokens as t
    inner join routed_runs using (run_id)
    where ($first_step::bigint is null or t.step >= $first_step::bigint)
        and ($last_step::bigint is null or t.step <= $last_step::bigint)
    group by t.run_id
)

select * from final order by run_id
