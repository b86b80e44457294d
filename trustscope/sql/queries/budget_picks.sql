-- which tokens each rule blocks on run $run_id at the scales $cuts (a list of {rule, u}: the rule blocks a token
-- whose score_<rule> is above u), over the tokens that carry gradient (a <> 0): counts by mu bucket, advantage
-- sign, entropy bucket and position in the response. rule '(all tokens)' holds every token with a <> 0, the
-- denominator of each group. the score columns are read in long form.
with cuts as (
    select cut.rule, cut.u from (select unnest($cuts) as cut)
),

tokens as (
    select
        mu_bucket,
        advantage_sign(advantage) as advantage_sign,
        entropy_bucket(entropy) as entropy_bucket,
        case
            when pos < 16 then '1: 0-15'
            when pos < 64 then '2: 16-63'
            when pos < 256 then '3: 64-255'
            when pos < 1024 then '4: 256-1023'
            else '5: >=1024'
        end as position,
        columns('^score_.*$')
    from rule_blocks
    where run_id = $run_id and advantage <> 0
),

long as (
    unpivot tokens
    on columns('^score_.*$')
    into name rule_column value score
),

picked as (
    select long.mu_bucket, long.advantage_sign, long.entropy_bucket, long.position, cuts.rule
    from long
    join cuts on long.rule_column = 'score_' || cuts.rule
    where long.score > cuts.u
    union all
    select mu_bucket, advantage_sign, entropy_bucket, position, '(all tokens)' as rule
    from tokens
),

final as (
    select
        rule,
        case
            when grouping(mu_bucket) = 0 then 'mu_bucket'
            when grouping(advantage_sign) = 0 then 'advantage_sign'
            when grouping(entropy_bucket) = 0 then 'entropy_bucket'
            else 'position'
        end as dimension,
        coalesce(mu_bucket, advantage_sign, entropy_bucket, position) as value,
        count(*)::bigint as n_blocked
    from picked
    group by grouping sets ((rule, mu_bucket), (rule, advantage_sign), (rule, entropy_bucket), (rule, position))
    order by rule, dimension, value
)

select * from final
