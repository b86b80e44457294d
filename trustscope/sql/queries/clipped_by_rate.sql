-- the token texts rule $rule blocks at the highest rate in run $run_id, steps $first_step..$last_step, among tokens
-- of advantage sign $adv_sign ('A>0', 'A<0' or 'any'; a = 0 tokens carry no gradient and never count) that occur at
-- least $min_count times: rate first, then the number blocked. the rule's column is read in long form, so the
-- rule name stays a bound value.
with window_blocks as (
    select token_id, mu_prob, entropy, advantage, columns('^blocks_.*$')
    from rule_blocks
    where run_id = $run_id and step between $first_step and $last_step and advantage <> 0
      and ($adv_sign = 'any' or (advantage > 0) = ($adv_sign = 'A>0'))
),

long as (
    unpivot window_blocks
    on columns('^blocks_.*$')
    into name rule_column value blocked
),

one_rule as (
    select token_id, mu_prob, entropy, blocked
    from long
    where rule_column = 'blocks_' || $rule
),

per_token as (
    select
        token_id,
        count(*) as n_occurrences,
        count(*) filter (where blocked) as n_blocked,
        avg(mu_prob) as mean_mu,
        avg(entropy) as mean_entropy
    from one_rule
    group by token_id
    having count(*) filter (where blocked) > 0 and count(*) >= $min_count
),

texts as (
    select token_id, text from vocab where run_id = $run_id
),

final as (
    select
        coalesce(texts.text, '#' || per_token.token_id::varchar) as text,
        per_token.token_id,
        n_blocked,
        n_occurrences,
        n_blocked / n_occurrences as block_rate,
        mean_mu,
        mu_bucket(mean_mu) as mu_bucket,
        mean_entropy
    from per_token
    left join texts using (token_id)
    order by block_rate desc, n_blocked desc, per_token.token_id
    limit $top
)

select * from final
