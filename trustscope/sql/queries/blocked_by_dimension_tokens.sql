-- blocked_by_dimension's rows from the token rows (token_dimensions), for the runs logged in full whose summaries hold
-- no dimension rows (imports, logs written before the dimensions): every rule of the counterfactual at the parameters
-- bound. trustscope.report_where.by_dimension runs it for the runs blocked_by_dimension leaves out, so a log whose
-- summaries cover every run never binds the token rows' rule scores. $run_ids, $first_step, $last_step as there.
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

final as (
    select
        run_id,
        dimension,
        bucket,
        any_value(bucket_label) as bucket_label,
        replace(rule_column, 'n_blocked__', '') as rule,
        sum(n_blocked)::bigint as n_blocked,
        sum(n_nonzero_advantage)::bigint as n_nonzero_advantage,
        sum(n_blocked) / nullif(sum(n_nonzero_advantage), 0) as blocked_frac
    from from_tokens
    group by run_id, dimension, bucket, rule_column
)

select * from final order by run_id, dimension, rule, bucket
