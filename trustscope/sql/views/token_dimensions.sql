-- one row per (run, step, summary dimension, bucket) computed from the token rows, for the runs whose summaries
-- hold no dimension rows but whose token rows are every token the logger was handed (logging.token_fraction 1 in
-- run.json): the imports, which log every token and leave the summaries out, and logs written before the
-- dimensions. the mergeable sums of summary_dimensions (tokens, |pi - mu| sum and max, importance-weight sums, bad
-- negative updates), exact as they are, and n_blocked__<rule>: the tokens with a != 0
-- each rule of the counterfactual (rule_blocks) blocks in the bucket. the dimensions' columns and buckets are
-- generated from trustscope/columns.py (DIMENSIONS: position_bucket(pos), turn, step - policy_version).
with complete as (
    select run_id
    from runs
    where coalesce(try_cast(json_extract_string(manifest, '$.logging.token_fraction') as double), 1.0) >= 1.0
        and run_id not in (select distinct run_id from summary_dimensions)
),

-- turn and policy_version are columns of the tokens, not of the counterfactual view: joined on the token's key
keys as (
    select run_id, step, rank, sample_id, pos, /* dimension columns */
    from token_metrics_core
    where run_id in (select run_id from complete)
),

tokens as (
    select
        b.run_id, b.step, b.pos, b.advantage, b.mu_prob, b.pi_prob, b.ratio,
        keys.* exclude (run_id, step, rank, sample_id, pos), columns('^blocks_.*$')
    from rule_blocks as b
    join keys using (run_id, step, rank, sample_id, pos)
),

long as (
    /* dimension buckets */
),

final as (
    select
        run_id,
        step,
        dimension,
        bucket,
        bucket_label(dimension, bucket) as bucket_label,
        count(*)::bigint as n_tokens,
        count_if(advantage != 0)::bigint as n_nonzero_advantage,
        sum(abs(pi_prob - mu_prob)) as sum_abs_prob_diff,
        max(abs(pi_prob - mu_prob)) as mismatch_max,
        sum(ratio) as w_sum,
        sum(ratio * ratio) as w_sum_sq,
        count_if(advantage < 0 and mu_prob - pi_prob >= analysis_param('bad_negative_delta'))::bigint
            as n_bad_negative,
        count_if(columns('^blocks_(.*)$') and advantage != 0)::bigint as 'n_blocked__\1'
    from long
    group by run_id, step, dimension, bucket
)

select * from final order by run_id, dimension, step, bucket
