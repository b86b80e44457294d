-- step_summary's blocked counts and fractions in long form, ready to plot: one row per (run, step, rule, advantage
-- side). n_blocked tokens of n_tokens: side 'all' counts the tokens that carry gradient (a != 0), 'positive' a > 0,
-- 'negative' a < 0; blocked_frac is null where the side has no token.
with wide as (
    select run_id, step, n_nonzero_advantage, n_positive, n_negative, columns('^n_blocked(_pos|_neg|)__.*$')
    from step_summary
),

long as (
    unpivot wide
    on columns('^n_blocked(_pos|_neg|)__.*$')
    into name column_name value n_blocked
),

sides as (
    select
        run_id,
        step,
        regexp_extract(column_name, '__(.*)$', 1) as rule,
        case
            when column_name like 'n_blocked_pos__%' then 'positive'
            when column_name like 'n_blocked_neg__%' then 'negative'
            else 'all'
        end as advantage_side,
        n_blocked,
        case
            when column_name like 'n_blocked_pos__%' then n_positive
            when column_name like 'n_blocked_neg__%' then n_negative
            else n_nonzero_advantage
        end as n_tokens
    from long
),

final as (
    select run_id, step, rule, advantage_side, n_blocked, n_tokens, n_blocked / nullif(n_tokens, 0) as blocked_frac
    from sides
    order by run_id, rule, advantage_side, step
)

select * from final
