-- the counterfactual between two rules on run $run_id, steps $first_step..$last_step: every token that carries
-- gradient (a <> 0) which $rule_a blocks and $rule_b keeps, or the other way round, with its text, probabilities,
-- advantage and place in the response. the rules' columns are read in long form, so the rule names stay bound
-- values (never identifiers formatted into sql).
with window_blocks as (
    select
        run_id, step, rank, sample_id, pos, token_id, mu_prob, pi_prob, ratio, binary_tv, advantage, mu_bucket,
        columns('^blocks_.*$')
    from rule_blocks
    where run_id = $run_id and step between $first_step and $last_step and advantage <> 0
),

long as (
    unpivot window_blocks
    on columns('^blocks_.*$')
    into name rule_column value blocked
),

two_rules as (
    select
        run_id, step, rank, sample_id, pos, token_id, mu_prob, pi_prob, ratio, binary_tv, advantage, mu_bucket,
        bool_or(blocked) filter (where rule_column = 'blocks_' || $rule_a) as a_blocks,
        bool_or(blocked) filter (where rule_column = 'blocks_' || $rule_b) as b_blocks
    from long
    where rule_column in ('blocks_' || $rule_a, 'blocks_' || $rule_b)
    group by all
),

texts as (
    select token_id, text from vocab where run_id = $run_id
),

final as (
    select
        two_rules.step,
        two_rules.rank,
        two_rules.sample_id,
        two_rules.pos,
        coalesce(texts.text, '#' || two_rules.token_id::varchar) as token_text,
        case when a_blocks then $rule_a else $rule_b end as blocked_by,
        case when a_blocks then $rule_b else $rule_a end as kept_by,
        case when advantage > 0 then 'A>0' else 'A<0' end as adv_sign,
        mu_bucket,
        mu_prob,
        pi_prob,
        ratio,
        binary_tv,
        advantage
    from two_rules
    left join texts using (token_id)
    where a_blocks is not null and b_blocks is not null and a_blocks <> b_blocks
    order by two_rules.step desc, two_rules.sample_id, two_rules.pos
)

select * from final
