-- trustscope explain's exact totals: per run and step, from the logger's summaries over every token (whatever
-- token_fraction logged): the token count, the sums of the importance weight pi / mu and of log(pi / mu) (the k3
-- estimator of kl(mu || pi) is their mean difference less 1), the sum of |pi - mu|, per rule the blocked tokens
-- (a non-zero advantage), and those the trainer's own mask blocked (trainer_blocked, a non-zero advantage too).
-- $run_ids: the runs, or null for all; $first_step: the first step read, or null.
with source as (
    select run_id, step, metric, rule, count, sum
    from summaries
    where dimension is null
        and metric in ('tokens', 'blocked', 'trainer_blocked', 'is_weight', 'log_ratio', 'abs_prob_diff')
        and not (metric = 'trainer_blocked' and advantage_sign = 'zero')
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

final as (
    select run_id, step, metric, rule, sum(count)::bigint as count, sum(sum) as sum
    from source
    group by all
)

select * from final order by run_id, step, metric, rule
