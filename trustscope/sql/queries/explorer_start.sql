-- where the token explorer opens on run $run_id: the latest step holding a token the trainer's own rule blocked
-- (else the latest step), and in it the response with the most blocked tokens, then the longest.
with per_sample as (
    select step, sample_id, count(*) filter (where not kept) as n_blocked, count(*) as n_logged
    from tokens
    where run_id = $run_id
    group by step, sample_id
),

final as (
    select step, sample_id, n_blocked, n_logged
    from per_sample
    order by (n_blocked > 0) desc, step desc, n_blocked desc, n_logged desc, sample_id
    limit 1
)

select * from final
