-- the responses of run $run_id at step $step whose tokens were logged (a run may log a fraction of them).
with logged as (
    select distinct sample_id
    from tokens
    where run_id = $run_id and step = $step
),

final as (
    select sample_id from logged order by sample_id
)

select * from final
