-- mergeable per-file counts behind clipped_tokens, one row per token id: how often it occurs, and for every rule
-- how often the rule blocks it, with the sums behind the blocked occurrences' mean mu probability and entropy.
-- only tokens that carry gradient (a != 0) count, as in every blocked fraction.
with blocks as (
    select run_id, source_file, token_id, mu_prob, entropy, columns('^blocks_.*$')
    from rule_blocks
    where advantage != 0
),

patterns as (
    -- few distinct block patterns per token id: sum each once, then split the sums by rule
    select
        run_id, source_file, token_id, columns('^blocks_.*$'),
        count(*) as n,
        sum(mu_prob) as sum_mu_prob,
        sum(entropy) as sum_entropy,
        count(entropy) as n_entropy
    from blocks
    group by all
),

final as (
    select
        run_id,
        source_file,
        token_id,
        sum(n)::bigint as n_occurrences,
        coalesce(sum(case when columns('^blocks_(.*)$') then n end), 0)::hugeint as 'n_blocked__\1',
        sum(case when columns('^blocks_(.*)$') then sum_mu_prob end) as 'sum_mu_prob__\1',
        sum(case when columns('^blocks_(.*)$') then sum_entropy end) as 'sum_entropy__\1',
        coalesce(sum(case when columns('^blocks_(.*)$') then n_entropy end), 0)::bigint as 'n_entropy__\1'
    from patterns
    group by run_id, source_file, token_id
)

select * from final
