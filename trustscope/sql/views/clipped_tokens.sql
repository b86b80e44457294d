-- token texts ranked, per run and rule, by how often the rule blocks them (a run's own rule at the parameters it
-- trained with, the others at their defaults), with the blocked occurrences' mean mu probability, its bucket and
-- mean entropy, and how often the token occurs; all counts over the tokens that carry gradient (a != 0).
-- reads the kept per-file counts (clipped_partials_cache), filled by trustscope.db before each query.
with partials as (
    select * from clipped_partials_cache
),

per_token as (
    select run_id, token_id, sum(columns('^n_.*$|^sum_.*$'))
    from partials
    group by run_id, token_id
),

long as (
    unpivot per_token
    on columns('^(n_blocked|sum_mu_prob|sum_entropy|n_entropy)__.*$')
    into name column_name value value
),

counts as (
    select
        run_id,
        regexp_extract(column_name, '__(.*)$', 1) as rule,
        token_id,
        any_value(n_occurrences)::bigint as n_occurrences,
        sum(value) filter (where column_name like 'n_blocked__%')::bigint as n_blocked,
        sum(value) filter (where column_name like 'sum_mu_prob__%') as sum_mu_prob,
        sum(value) filter (where column_name like 'sum_entropy__%') as sum_entropy,
        sum(value) filter (where column_name like 'n_entropy__%') as n_entropy
    from long
    group by all
),

blocked as (
    select
        run_id,
        rule,
        token_id,
        n_blocked,
        n_occurrences,
        sum_mu_prob / n_blocked as mu_prob_mean,
        sum_entropy / nullif(n_entropy, 0) as entropy_mean
    from counts
    where n_blocked > 0
),

texts as (
    select run_id, token_id, text as token_text from vocab
),

final as (
    select
        blocked.run_id,
        blocked.rule,
        row_number() over (
            partition by blocked.run_id, blocked.rule order by blocked.n_blocked desc, blocked.token_id
        ) as rank,
        blocked.token_id,
        texts.token_text,
        blocked.n_blocked,
        blocked.n_occurrences,
        blocked.n_blocked / blocked.n_occurrences as block_rate,
        blocked.n_blocked / sum(blocked.n_blocked) over (partition by blocked.run_id, blocked.rule) as block_share,
        blocked.mu_prob_mean,
        mu_bucket(blocked.mu_prob_mean) as mu_bucket,
        blocked.entropy_mean
    from blocked
    left join texts using (run_id, token_id)
    order by blocked.run_id, blocked.rule, rank
)

select * from final
