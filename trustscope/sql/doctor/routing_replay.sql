-- routing replay health: on tokens that carry both sides' routed experts, how many disagree anywhere (routing_agreement
-- below 1), the share of (layer, slot) choices that disagree, and the least agreeing tokens, per run; the judge holds
-- a run declared replayed (run.json's routing_replay) to full agreement. $run_ids: the runs read, or null for all;
-- $first_step: the first step read, or null for all.
with source as (
    select run_id, step, sample_id, pos, routing_agreement, engine_experts, trainer_experts
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_run as (
    select
        run_id,
        count(*) as n_tokens,
        count(routing_agreement) as n_routed,
        count_if(routing_agreement < 1) as n_disagree,
        count(distinct step) filter (where routing_agreement < 1) as n_steps_disagree,
        1 - avg(routing_agreement) as choice_disagreement,
        min_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'routing_agreement': routing_agreement,
             'engine_experts': engine_experts, 'trainer_experts': trainer_experts},
            routing_agreement, 3
        ) filter (where routing_agreement < 1) as examples
    from source
    group by run_id
)

select * from per_run order by run_id
