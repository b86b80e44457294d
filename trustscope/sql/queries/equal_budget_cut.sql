-- the equal-budget cut of every rule with a scalar threshold on run $run_id, from its logged rows: the rule at
-- scale u blocks the tokens whose score_<rule> (rule_blocks) is above u, so over the tokens that carry gradient
-- (a <> 0) the distinct scores, highest first, give every count the rule can block: at_or_above tokens for u
-- between next_score and score. the row per rule whose count is nearest to round($share * n_tokens) (ties: the
-- smaller count);
-- a row with score null is the cut above every score (nothing blocked). n_tokens: the run's tokens with a <> 0,
-- n_blockable: those some scale blocks. the score columns are read in long form (rule names stay values:
-- the table macro rule_scores).
with counted as (
    select rule_column, score, count(*)::bigint as n
    from rule_scores($run_id)
    where score > 0
    group by all
),

ranked as (
    select
        rule_column,
        score,
        lead(score) over by_score as next_score,
        sum(n) over (by_score rows between unbounded preceding and current row)::bigint as at_or_above
    from counted
    window by_score as (partition by rule_column order by score desc)
),

candidates as (
    select rule_column, score, next_score, at_or_above from ranked
    union all
    select rule_column, null as score, max(score) as next_score, 0::bigint as at_or_above
    from counted
    group by all
),

n_tokens as (
    select count(*)::bigint as n_tokens, round($share * count(*))::bigint as target
    from rule_blocks
    where run_id = $run_id and advantage <> 0
),

chosen as (
    select candidates.*
    from candidates
    cross join n_tokens
    qualify row_number() over (partition by rule_column order by abs(at_or_above - target), at_or_above) = 1
),

totals as (
    select rule_column, sum(n)::bigint as n_blockable from counted group by all
),

final as (
    select
        substr(chosen.rule_column, 7) as rule,
        chosen.score,
        chosen.next_score,
        chosen.at_or_above as n_blocked,
        totals.n_blockable,
        n_tokens.n_tokens,
        n_tokens.target
    from chosen
    join totals using (rule_column)
    cross join n_tokens
    order by rule
)

select * from final
