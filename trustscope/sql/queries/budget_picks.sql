-- which tokens each rule blocks on run $run_id at the scales $cuts (a list of {rule, u}: the rule blocks a token
-- whose score_<rule> is above u), over the tokens that carry gradient (a <> 0): counts by mu bucket, advantage
-- sign, entropy bucket, position in the response, and turn and staleness where the run logged them (a dimension
-- whose every token has it null is left out; a token without it in a run that has it counts as 'not logged').
-- rule '(all tokens)' holds every token with a <> 0, the denominator of each group. the score columns are read in
-- long form.
with cuts as (
    select cut.rule, cut.u from (select unnest($cuts) as cut)
),

-- turn and staleness are columns of the tokens, not of the counterfactual view: joined on the token's key
dims as (
    select run_id, step, rank, sample_id, pos, turn, staleness
    from token_metrics_core
    where run_id = $run_id
),

logged as (
    select count(turn) > 0 as has_turn, count(staleness) > 0 as has_staleness from dims
),

tokens as (
    select
        rule_blocks.mu_bucket,
        advantage_sign(advantage) as advantage_sign,
        entropy_bucket(entropy) as entropy_bucket,
        case
            when pos < 16 then '1: 0-15'
            when pos < 64 then '2: 16-63'
            when pos < 256 then '3: 64-255'
            when pos < 1024 then '4: 256-1023'
            else '5: >=1024'
        end as position,
        case when logged.has_turn then coalesce(dims.turn::varchar, 'not logged') end as turn,
        case when logged.has_staleness then coalesce(dims.staleness::varchar, 'not logged') end as staleness,
        columns('^score_.*$')
    from rule_blocks
    cross join logged
    left join dims using (run_id, step, rank, sample_id, pos)
    where rule_blocks.run_id = $run_id and rule_blocks.advantage <> 0
),

long as (
    unpivot tokens
    on columns('^score_.*$')
    into name rule_column value score
),

picked as (
    select long.mu_bucket, long.advantage_sign, long.entropy_bucket, long.position, long.turn, long.staleness,
        cuts.rule
    from long
    join cuts on long.rule_column = 'score_' || cuts.rule
    where long.score > cuts.u
    union all
    select mu_bucket, advantage_sign, entropy_bucket, position, turn, staleness, '(all tokens)' as rule
    from tokens
),

final as (
    select
        rule,
        case
            when grouping(mu_bucket) = 0 then 'mu_bucket'
            when grouping(advantage_sign) = 0 then 'advantage_sign'
            when grouping(entropy_bucket) = 0 then 'entropy_bucket'
            when grouping(position) = 0 then 'position'
            when grouping(turn) = 0 then 'turn'
            else 'staleness'
        end as dimension,
        coalesce(mu_bucket, advantage_sign, entropy_bucket, position, turn, staleness) as value,
        count(*)::bigint as n_blocked
    from picked
    group by grouping sets ((rule, mu_bucket), (rule, advantage_sign), (rule, entropy_bucket), (rule, position),
                            (rule, turn), (rule, staleness))
)

-- a dimension the run did not log (null for every token) has no rows; numbers sort as numbers
select * from final
where value is not null or dimension not in ('turn', 'staleness')
order by rule, dimension, try_cast(value as bigint) nulls last, value
