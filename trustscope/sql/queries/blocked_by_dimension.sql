-- the page "where the mismatch lives" and the report: per run, summary dimension, bucket and rule, over the steps
-- [$first_step, $last_step] (null: every step) taken together: the tokens the rule blocks among those that carry
-- gradient (a != 0), and their fraction. $run_ids: the runs, or null for all. a run logged in full without the
-- summaries' dimension rows (an import) gets the same rows from its token rows (token_dimensions), every rule of
-- the counterfactual at the parameters bound.
with from_tokens as (
    unpivot (
        select run_id, step, dimension, bucket, bucket_label, n_nonzero_advantage, columns('^n_blocked__.*$')
        from token_dimensions
        where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
            and ($first_step::bigint is null or step >= $first_step::bigint)
            and ($last_step::bigint is null or step <= $last_step::bigint)
    )
    on columns('^n_blocked__.*$')
    into name rule_column value n_blocked
),

rows as (
    select run_id, step, dimension, bucket, bucket_label, rule, n_blocked, n_nonzero_advantage
    from summary_dimension_blocked
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
    union all
    select run_id, step, dimension, bucket, bucket_label, replace(rule_column, 'n_blocked__', '') as rule, n_blocked,
        n_nonzero_advantage
    from from_tokens
),

final as (
    select
        run_id,
        dimension,
        bucket,
        any_value(bucket_label) as bucket_label,
        rule,
        sum(n_blocked)::bigint as n_blocked,
        sum(n_nonzero_advantage)::bigint as n_nonzero_advantage,
        sum(n_blocked) / nullif(sum(n_nonzero_advantage), 0) as blocked_frac
    from rows
    group by run_id, dimension, bucket, rule
)

select * from final order by run_id, dimension, rule, bucket
