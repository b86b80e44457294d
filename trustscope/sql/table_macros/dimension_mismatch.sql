-- the figures of "where the mismatch lives" per run, summary dimension and bucket, over the steps
-- [first_step, last_step] (null: every step) taken together, from `source`: the name of a view of per-step
-- dimension rows with summary_dimensions' mergeable sums ('summary_dimensions', or 'token_dimensions' for the runs
-- logged in full without them). tokens, mismatch mean, ess_frac from the merged importance-weight sums, bad
-- negative-update rate. `run_ids`: the runs, or null for all. mismatch_by_dimension and
-- mismatch_by_dimension_tokens call it, one source each, so a log whose summaries cover every run never binds the
-- token rows.
create or replace macro dimension_mismatch(source, run_ids, first_step, last_step) as table
    with rows as (
        select run_id, step, dimension, bucket, bucket_label, n_tokens, n_nonzero_advantage, sum_abs_prob_diff,
            mismatch_max, w_sum, w_sum_sq, n_bad_negative
        from query_table(source)
        where (run_ids::varchar[] is null or list_contains(run_ids::varchar[], run_id))
            and (first_step::bigint is null or step >= first_step::bigint)
            and (last_step::bigint is null or step <= last_step::bigint)
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
