-- what every rule would block on the same tokens of run $run_id, steps $first_step..$last_step, by mu bucket and
-- advantage sign. only tokens that carry gradient (a <> 0) count: an a = 0 token moves nothing whichever rule
-- looks at it, so the fractions are over a > 0 and a < 0 tokens, with their counts beside them.
with window_blocks as (
    select
        mu_bucket,
        case when advantage > 0 then 'A>0' else 'A<0' end as adv_sign,
        columns('^blocks_.*$')
    from rule_blocks
    where run_id = $run_id and step between $first_step and $last_step and advantage <> 0
),

counts as (
    select mu_bucket, adv_sign, count(*) as n_tokens, sum(columns('^blocks_.*$')::integer)
    from window_blocks
    group by mu_bucket, adv_sign
),

long as (
    unpivot counts
    on columns('^blocks_.*$')
    into name rule_column value n_blocked
),

final as (
    select
        regexp_extract(rule_column, '^blocks_(.*)$', 1) as rule,
        mu_bucket,
        adv_sign,
        n_tokens,
        n_blocked,
        n_blocked / n_tokens as blocked_frac
    from long
    order by rule, mu_bucket, adv_sign
)

select * from final
