-- mismatch_by_dimension's rows from the token rows (token_dimensions), for the runs logged in full whose summaries hold
-- no dimension rows (imports, logs written before the dimensions). trustscope.report_where.by_dimension runs it for the
-- runs mismatch_by_dimension leaves out. $run_ids, $first_step, $last_step as there.
with dimension_rows as (
    select run_id, step, dimension, bucket, bucket_label, n_tokens, n_nonzero_advantage, sum_abs_prob_diff,
        mismatch_max, w_sum, w_sum_sq, n_bad_negative
    from token_dimensions
),

rows as (
    select *
    from dimension_rows
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and ($last_step::bigint is null or step <= $last_step::bigint)
),

final as (
    select
        run_id,
        dimension,
        bucket,
        any_value(bucket_label) as bucket_label,
        count(distinct step)::bigint as n_steps,
        sum(n_tokens)::bigint as n_tokens,
        sum(n_nonzero_advantage)::bigint as n_nonzero_advantage,
        sum(sum_abs_prob_diff) / nullif(sum(n_tokens), 0) as mismatch_mean,
        max(mismatch_max) as mismatch_max,
        sum(w_sum) * sum(w_sum) / nullif(sum(w_sum_sq), 0) / nullif(sum(n_tokens), 0) as ess_frac,
        sum(n_bad_negative)::bigint as n_bad_negative,
        sum(n_bad_negative) / nullif(sum(n_tokens), 0) as bad_negative_rate
    from rows
    group by run_id, dimension, bucket
)

select * from final order by run_id, dimension, bucket
