-- step_summary's blocked fractions in long form, ready to plot: one row per (run, step, rule, advantage side).
with wide as (
    select run_id, step, columns('^blocked_frac(_pos|_nonpos|)__.*$')
    from step_summary
),

long as (
    unpivot wide
    on columns('^blocked_frac(_pos|_nonpos|)__.*$')
    into name column_name value blocked_frac
),

final as (
    select
        run_id,
        step,
        regexp_extract(column_name, '__(.*)$', 1) as rule,
        case
            when column_name like 'blocked_frac_pos__%' then 'positive'
            when column_name like 'blocked_frac_nonpos__%' then 'non_positive'
            else 'all'
        end as advantage_side,
        blocked_frac
    from long
    order by run_id, rule, advantage_side, step
)

select * from final
