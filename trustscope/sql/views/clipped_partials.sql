-- mergeable per-file counts behind clipped_tokens, one row per token id: how often it occurs, and for every rule
-- how often the rule blocks it, with the sums behind the blocked occurrences' mean mu probability and entropy.
with blocks as (
    select run_id, source_file, token_id, mu_prob, entropy, columns('^blocks_.*$')
    from rule_blocks
),

final as (
    select
        run_id,
        source_file,
        token_id,
        count(*) as n_occurrences,
        count_if(columns('^blocks_(.*)$')) as 'n_blocked__\1',
        sum(case when columns('^blocks_(.*)$') then mu_prob end) as 'sum_mu_prob__\1',
        sum(case when columns('^blocks_(.*)$') then entropy end) as 'sum_entropy__\1',
        count(case when columns('^blocks_(.*)$') then entropy end) as 'n_entropy__\1'
    from blocks
    group by run_id, source_file, token_id
)

select * from final
