-- blocked_fractions' rows (run, step, rule, advantage side, n_blocked of n_tokens) from the summaries table: exact
-- over every token the trainer handed to the logger. side 'all' counts the tokens that carry gradient (a != 0),
-- 'positive' a > 0, 'negative' a < 0 (the summaries count blocked tokens by sign and mu bucket, a = 0 left out);
-- every rule the logger ran appears at every step of the run, with 0 where it blocked nothing.
with summ as (
    select run_id, step, metric, rule, advantage_sign, count
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where metric in ('tokens', 'blocked') and dimension is null
),

sides as (
    select run_id, step, advantage_sign as advantage_side, sum(count)::bigint as n_tokens
    from summ
    where metric = 'tokens' and advantage_sign != 'zero'
    group by all
    union all
    select run_id, step, 'all' as advantage_side, sum(count)::bigint as n_tokens
    from summ
    where metric = 'tokens' and advantage_sign != 'zero'
    group by all
),

rules as (
    select distinct run_id, rule from summ where metric = 'blocked'
),

blocked as (
    select run_id, step, rule, advantage_sign as advantage_side, sum(count)::bigint as n_blocked
    from summ
    where metric = 'blocked'
    group by all
    union all
    select run_id, step, rule, 'all' as advantage_side, sum(count)::bigint as n_blocked
    from summ
    where metric = 'blocked'
    group by all
),

final as (
    select
        s.run_id,
        s.step,
        r.rule,
        s.advantage_side,
        coalesce(b.n_blocked, 0)::bigint as n_blocked,
        s.n_tokens,
        coalesce(b.n_blocked, 0) / nullif(s.n_tokens, 0) as blocked_frac
    from sides as s
    join rules as r using (run_id)
    left join blocked as b using (run_id, step, rule, advantage_side)
    order by s.run_id, r.rule, s.advantage_side, s.step
)

select * from final
