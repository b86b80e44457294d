-- grpo groups whose rewards are all equal: the responses of one prompt_id at one step (two or more, rewards
-- logged), whose group-relative advantages are then all 0 (no gradient), yet whose tokens count in the loss's
-- denominators. one row per run: groups, zero-variance groups, the tokens (response lengths) in them, examples.
-- $run_ids: the runs read, or null for all; $first_step: the first step read, or null for all.
with source as (
    select run_id, step, prompt_id, reward, length
    from samples
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and reward is not null
),

groups as (
    select
        run_id,
        step,
        prompt_id,
        count(*) as n_responses,
        min(reward) as reward_min,
        max(reward) as reward_max,
        sum(length)::bigint as n_tokens
    from source
    group by all
    having count(*) >= 2
),

final as (
    select
        run_id,
        count(*) as n_groups,
        count_if(reward_min = reward_max) as n_zero_variance,
        count(distinct step) as n_steps,
        sum(n_tokens)::bigint as n_tokens,
        coalesce(sum(n_tokens) filter (where reward_min = reward_max), 0)::bigint as n_tokens_zero_variance,
        max_by(
            {'step': step, 'prompt_id': prompt_id, 'reward': reward_min, 'n_responses': n_responses},
            step, 3
        ) filter (where reward_min = reward_max) as examples
    from groups
    group by run_id
)

select * from final order by run_id
