-- trustscope explain: the logged tokens of every response grouped by which causes touch them (the indicators of
-- the table macro explain_tokens; null: not measurable there), by the logger's blocked_rules bits, by the trainer's
-- kept mask and by whether the advantage is non-zero (the tokens whose block matters, as the summaries count
-- them), with per group the token count and the sums of |log pi - log mu| and of the k3 estimator. one row per
-- (run, step, rank, response, pattern, bits, kept, signed): what explain allocates and bootstraps over responses.
-- rows without bits (imports, older logs) are counted by rule through explain_rule_blocks instead.
-- $run_ids: the runs, or null for all; $first_step / $last_step: the first and last step read, or null; the rest
-- are the indicators' thresholds.
with flagged as (
    select *
    from explain_tokens($run_ids, $first_step, $last_step, $shift_factor, $shift_floor, $min_r2,
                        $temperature_tolerance, $truncation_offset)
),

final as (
    select
        run_id, step, rank, sample_id, stale, routing, drift, shift, temperature, truncation, blocked_rules, kept,
        advantage != 0 as signed,
        count(*) as n_tokens,
        sum(abs_log_ratio) as sum_abs_log_ratio,
        sum(k3) as sum_k3
    from flagged
    group by all
)

select * from final order by run_id, step, rank, sample_id
