-- verl's rollout importance-sampling figures (rollout_corr/rollout_is_* of verl/trainer/ppo/rollout_corr_helper.py
-- compute_rollout_correction_weights and compute_is_metrics), one row per (run, step, rollout_is level): 'token'
-- (a weight per token, pi_train / mu) and 'sequence' (one per sequence, the product of its tokens' ratios). the
-- threshold is verl's rollout_is_threshold, bound as the analysis parameters verl_rollout_is_threshold (upper) and
-- verl_rollout_is_threshold_lower (0: verl's single-float form, TIS, weights clamped at the upper bound and the low
-- fraction measured against 1 / upper; > 0: the "lower_upper" form, IcePop, weights outside the bounds zeroed).
-- sides and rows as verl_rollout_corr. declared in trustscope/framework_metrics.py.
with bounds as (
    select
        analysis_param('verl_rollout_is_threshold')::double as upper_bound,
        analysis_param('verl_rollout_is_threshold_lower')::double as lower_given,
        analysis_param('verl_rollout_is_threshold_lower')::double > 0 as icepop
),

source as (
    select
        run_id,
        step,
        sample_id,
        coalesce(update_index, -1) as update_key,
        coalesce(old_logprob, pi_logprob)::double - mu_logprob::double as log_ratio
    from tokens
),

-- a unit carries one weight over n_tokens tokens: a token (rollout_is 'token'), or a whole sequence ('sequence'),
-- whose weight verl broadcasts over its tokens; token-level figures weigh a unit by its n_tokens.
units as (
    select run_id, step, sample_id, update_key, 'token' as rollout_is, 1 as n_tokens, log_ratio as log_weight
    from source
    union all
    select run_id, step, sample_id, update_key, 'sequence', count(*), sum(log_ratio)
    from source
    group by run_id, step, sample_id, update_key
),

weights as (
    select
        u.*,
        b.upper_bound,
        case when b.icepop then b.lower_given else 1.0 / b.upper_bound end as lower_bound,
        b.icepop,
        exp(least(greatest(u.log_weight, -20.0), 20.0)) as raw_weight
    from units as u
    cross join bounds as b
),

applied as (
    select
        *,
        case
            when not icepop then least(raw_weight, upper_bound)
            when raw_weight >= lower_bound and raw_weight <= upper_bound then raw_weight
            else 0.0
        end as weight
    from weights
),

token_stats as (
    select
        run_id,
        step,
        rollout_is,
        sum(n_tokens) as n_tokens,
        sum(n_tokens * weight) / sum(n_tokens) as is_mean,
        max(weight) as token_max,
        min(weight) as token_min,
        sum(n_tokens * (raw_weight > upper_bound)::double) / sum(n_tokens) as token_fraction_high,
        sum(n_tokens * (raw_weight < lower_bound)::double) / sum(n_tokens) as token_fraction_low,
        sum(n_tokens * least(greatest(weight, 0.0), upper_bound)) / sum(n_tokens) as mean_clamped,
        sum(n_tokens * least(greatest(weight, 0.0), upper_bound) ^ 2) / sum(n_tokens) as mean_clamped_sq,
        case when bool_or(icepop) then
            sum(n_tokens * (raw_weight < lower_bound or raw_weight > upper_bound)::double) / sum(n_tokens) end
            as oob_ratio,
        any_value(upper_bound) as upper_bound,
        any_value(lower_bound) as lower_bound
    from applied
    group by run_id, step, rollout_is
),

per_sequence as (
    select
        run_id,
        step,
        'token' as rollout_is,
        avg(weight) as seq_weight,
        avg(raw_weight) as raw_seq_weight,
        null::double as log_weight_sum
    from applied
    where rollout_is = 'token'
    group by run_id, step, sample_id, update_key
    union all
    select run_id, step, rollout_is, weight, raw_weight, log_weight
    from applied
    where rollout_is = 'sequence'
),

sequence_stats as (
    select
        p.run_id,
        p.step,
        p.rollout_is,
        count(*) as n_sequences,
        avg(p.seq_weight) as seq_mean,
        coalesce(stddev_samp(p.seq_weight), 0.0) as seq_std,
        max(p.seq_weight) as seq_max,
        min(p.seq_weight) as seq_min,
        max(abs(p.seq_weight - 1.0)) as seq_max_deviation,
        avg((p.raw_seq_weight > t.upper_bound)::double) as seq_fraction_high,
        avg((p.raw_seq_weight < t.lower_bound)::double) as seq_fraction_low,
        exp(least(max(p.log_weight_sum), 20.0)) as seq_log_max,
        exp(min(p.log_weight_sum)) as seq_log_min,
        avg((p.log_weight_sum > ln(t.upper_bound))::double) as seq_log_fraction_high,
        avg((p.log_weight_sum < ln(t.lower_bound))::double) as seq_log_fraction_low
    from per_sequence as p
    inner join token_stats as t using (run_id, step, rollout_is)
    group by p.run_id, p.step, p.rollout_is
),

final as (
    select
        t.run_id,
        t.step,
        t.rollout_is,
        t.n_tokens,
        s.n_sequences,
        t.is_mean as "rollout_corr/rollout_is_mean",
        case when t.rollout_is = 'token' then t.token_max else s.seq_log_max end as "rollout_corr/rollout_is_max",
        case when t.rollout_is = 'token' then t.token_min else s.seq_log_min end as "rollout_corr/rollout_is_min",
        case when t.n_tokens > 1 then sqrt(greatest(t.mean_clamped_sq - t.mean_clamped ^ 2, 0.0)) else 0.0 end
            as "rollout_corr/rollout_is_std",
        1.0 / (t.mean_clamped_sq / (t.mean_clamped + 1e-8) ^ 2) as "rollout_corr/rollout_is_eff_sample_size",
        case when t.rollout_is = 'token' then t.token_fraction_high else s.seq_log_fraction_high end
            as "rollout_corr/rollout_is_ratio_fraction_high",
        case when t.rollout_is = 'token' then t.token_fraction_low else s.seq_log_fraction_low end
            as "rollout_corr/rollout_is_ratio_fraction_low",
        s.seq_mean as "rollout_corr/rollout_is_seq_mean",
        s.seq_std as "rollout_corr/rollout_is_seq_std",
        s.seq_max as "rollout_corr/rollout_is_seq_max",
        s.seq_min as "rollout_corr/rollout_is_seq_min",
        s.seq_max_deviation as "rollout_corr/rollout_is_seq_max_deviation",
        s.seq_fraction_high as "rollout_corr/rollout_is_seq_fraction_high",
        s.seq_fraction_low as "rollout_corr/rollout_is_seq_fraction_low",
        t.oob_ratio as "rollout_corr/rollout_is_oob_ratio"
    from token_stats as t
    inner join sequence_stats as s using (run_id, step, rollout_is)
    order by t.run_id, t.step, t.rollout_is
)

select * from final
