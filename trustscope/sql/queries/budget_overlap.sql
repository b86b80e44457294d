-- two rules on run $run_id at the scales $u_a and $u_b (a rule blocks a token whose score_<rule> is above its
-- scale), over the tokens that carry gradient (a <> 0): per token text, how many both block, only $rule_a, only
-- $rule_b. pick: 'both', 'only a', 'only b'. the score columns are read in long form.
with scored as (
    select step, rank, sample_id, pos, token_id, columns('^score_.*$')
    from rule_blocks
    where run_id = $run_id and advantage <> 0
),

long as (
    unpivot scored
    on columns('^score_.*$')
    into name rule_column value score
),

flags as (
    select
        step, rank, sample_id, pos, token_id,
        coalesce(bool_or(score > $u_a) filter (where rule_column = 'score_' || $rule_a), false) as a_blocks,
        coalesce(bool_or(score > $u_b) filter (where rule_column = 'score_' || $rule_b), false) as b_blocks
    from long
    where rule_column in ('score_' || $rule_a, 'score_' || $rule_b)
    group by all
),

texts as (
    select token_id, text from vocab where run_id = $run_id
),

final as (
    select
        case when a_blocks and b_blocks then 'both' when a_blocks then 'only a' else 'only b' end as pick,
        coalesce(texts.text, '#' || flags.token_id::varchar) as token_text,
        count(*)::bigint as n
    from flags
    left join texts using (token_id)
    where a_blocks or b_blocks
    group by all
    order by pick, n desc, token_text
)

select * from final
