-- the trainer's own per-step scalars named in $names (mean over ranks), for the runs in $run_ids.
with chosen as (
    select run_id, step, name, value
    from steps
    where list_contains($run_ids, run_id) and list_contains($names, name)
),

final as (
    select run_id, step, name, avg(value) as value
    from chosen
    group by run_id, step, name
    order by run_id, name, step
)

select * from final
