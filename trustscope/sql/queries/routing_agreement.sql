-- the page "where the mismatch lives" and the report, for mixture-of-experts runs: routing agreement exact over every
-- token the trainer handed to the logger (the summaries' moments, whatever token_fraction kept), per run over the
-- steps [$first_step, $last_step] (null: every step): overall (dimension null), per MoE layer and per position
-- bucket, and per first differing layer (dimension routing): tokens and the mean share of the engine's (layer, slot)
-- choices the trainer also made; under routing replay with the router's own pick logged, the replace rate beside it
-- (the share of the router's own choices the replay replaced, overall and per MoE layer; null elsewhere).
-- $run_ids: the runs, or null for all.
with rows as (
    select run_id, metric, dimension, bucket, count, mean
    from summaries
    where metric in ('routing_agreement', 'routing_replaced') and count > 0
        and ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

final as (
    select
        run_id,
        coalesce(dimension, 'all') as dimension,
        bucket,
        case
            when dimension = 'layer' then 'layer ' || bucket::bigint
            when dimension = 'position' then position_bucket_label(bucket::bigint)
            when dimension = 'routing' and bucket = -1 then 'no layer differs'
            when dimension = 'routing' and bucket = -2 then 'no engine routing'
            when dimension = 'routing' then 'first differing layer ' || bucket::bigint
            else 'all'
        end as label,
        sum(count) filter (where metric = 'routing_agreement')::bigint as n_tokens,
        sum(mean * count) filter (where metric = 'routing_agreement')
            / sum(count) filter (where metric = 'routing_agreement') as agreement,
        sum(mean * count) filter (where metric = 'routing_replaced')
            / sum(count) filter (where metric = 'routing_replaced') as replace_rate
    from rows
    group by all
    having sum(count) filter (where metric = 'routing_agreement') > 0
)

select * from final order by run_id, dimension, bucket
