-- the loss rule each run's tokens were logged under (for runs whose manifest does not name one).
with rules as (
    select run_id, any_value(loss_rule) as loss_rule
    from tokens
    where loss_rule is not null
    group by run_id
),

final as (
    select * from rules order by run_id
)

select * from final
