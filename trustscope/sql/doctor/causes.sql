-- the detectors of trustscope explain's causes (doctor checks cause_*), one row per run over the table macro
-- explain_tokens: per cause the tokens it touches (and those where it is measurable), their mean |log pi - log mu|
-- against the untouched tokens', the detector's own evidence (the fitted temperature, the truncation offset and
-- masses, the shift's fits, the first drifting positions, the mismatch by staleness, by routing agreement, and on
-- untouched tokens by position bucket and by turn), and the largest examples. $run_ids: the runs, or null for all;
-- $first_step: the first step read, or null; the rest are explain's thresholds.
with flagged as (
    select
        *,
        not (coalesce(stale, false) or coalesce(routing, false) or coalesce(drift, false) or shift
             or coalesce(temperature, false) or coalesce(truncation, false)) as untouched
    from explain_tokens($run_ids, $first_step, null, $shift_factor, $shift_floor, $min_r2, $temperature_tolerance,
                        $truncation_offset)
),

per_run as (
    select
        run_id,
        count(*) as n_tokens,
        count_if(untouched) as n_untouched,
        avg(abs_log_ratio) filter (where untouched) as untouched_mismatch,
        avg(abs_log_ratio) as mismatch,
        -- temperature
        count(temperature) as temperature_measured,
        count_if(temperature) as temperature_tokens,
        avg(abs_log_ratio) filter (where temperature) as temperature_mismatch,
        median(fit_temperature) filter (where temperature) as temperature_fit,
        median(fit_temperature) filter (where temperature is not null and fit_r2 >= $min_r2) as temperature_fit_all,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'fit_temperature': fit_temperature,
                'fit_r2': fit_r2, 'abs_log_ratio': abs_log_ratio}, abs_log_ratio, 3) filter (where temperature)
            as temperature_examples,
        -- truncation
        count(truncation) as truncation_measured,
        count_if(truncation) as truncation_tokens,
        avg(abs_log_ratio) filter (where truncation) as truncation_mismatch,
        median(fit_offset) filter (where truncation) as truncation_offset_fit,
        avg(response_mu_mass) filter (where truncation) as truncation_mu_mass,
        avg(response_pi_mass) filter (where truncation) as truncation_pi_mass,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'fit_offset': fit_offset,
                'mu_topk_mass': response_mu_mass, 'pi_topk_mass': response_pi_mass}, abs_log_ratio, 3)
            filter (where truncation) as truncation_examples,
        -- position shift
        count_if(shift) as shift_tokens,
        avg(abs_log_ratio) filter (where shift) as shift_mismatch,
        avg(shift_pi_later) filter (where shift) as shift_pi_later,
        avg(shift_pi_earlier) filter (where shift) as shift_pi_earlier,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn, 'logged': shift_logged,
                'pi_later': shift_pi_later, 'pi_earlier': shift_pi_earlier}, abs_log_ratio, 3) filter (where shift)
            as shift_examples,
        -- token drift
        count(drift) as drift_measured,
        count_if(drift) as drift_tokens,
        avg(abs_log_ratio) filter (where drift) as drift_mismatch,
        min(first_drift_pos) as drift_first_pos,
        median(first_drift_pos) as drift_median_first_pos,
        min_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'turn': turn}, step * 1000000 + pos, 3)
            filter (where drift and pos = first_drift_pos) as drift_examples,
        -- staleness
        count(stale) as stale_measured,
        count_if(stale) as stale_tokens,
        avg(abs_log_ratio) filter (where stale) as stale_mismatch,
        max(staleness) as max_staleness,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'staleness': staleness,
                'abs_log_ratio': abs_log_ratio}, abs_log_ratio, 3) filter (where stale) as stale_examples,
        -- routing
        count(routing) as routing_measured,
        count_if(routing) as routing_tokens,
        avg(abs_log_ratio) filter (where routing) as routing_mismatch,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'abs_log_ratio': abs_log_ratio}, abs_log_ratio, 3)
            filter (where routing) as routing_examples,
        -- numerics: untouched tokens, the first generated token apart
        avg(abs_log_ratio) filter (where untouched and pos = 0) as numerics_first_token,
        avg(abs_log_ratio) filter (where untouched and pos > 0) as numerics_rest
    from flagged
    group by run_id
),

by_turn as (
    select run_id, list({'turn': turn, 'tokens': n, 'shift_tokens': n_shift, 'drift_tokens': n_drift,
                         'untouched_mismatch': m} order by turn nulls first) as turns
    from (
        select run_id, turn, count(*) as n, count_if(shift)::bigint as n_shift, count_if(drift)::bigint as n_drift,
            avg(abs_log_ratio) filter (where untouched) as m
        from flagged
        group by all
    )
    group by run_id
),

by_staleness as (
    select run_id, list({'staleness': staleness, 'tokens': n, 'mismatch': m} order by staleness) as staleness_rows
    from (
        select run_id, staleness, count(*) as n, avg(abs_log_ratio) as m
        from flagged
        where staleness is not null
        group by all
    )
    group by run_id
),

by_position as (
    select run_id, list({'position': b, 'tokens': n, 'mismatch': m} order by b) as position_rows
    from (
        select run_id, position_bucket(pos) as b, count(*) as n, avg(abs_log_ratio) as m
        from flagged
        where untouched
        group by all
    )
    group by run_id
),

final as (
    select p.*, t.turns, s.staleness_rows, q.position_rows
    from per_run as p
    left join by_turn as t using (run_id)
    left join by_staleness as s using (run_id)
    left join by_position as q using (run_id)
)

select * from final order by run_id
