-- the early-warning signals per step (the early_signals view), for the runs in $run_ids.
with final as (
    select *
    from early_signals
    where list_contains($run_ids, run_id)
    order by run_id, step
)

select * from final
