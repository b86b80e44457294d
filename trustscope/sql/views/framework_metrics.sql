-- every framework figure trustscope reproduces, long-form: one row per (run, step, framework, metric, variant) with
-- the name the framework logs it under (metric), the setting it is computed under (variant: verl's rollout_is level,
-- slime's calculate_per_token_loss, TRL's vllm_importance_sampling_mode; null: the framework's default or its only
-- way), its value, the rows and sequences it is taken over, and exact: false where the run's logger kept a sample
-- of the token rows (token_fraction < 1 in run.json), so the figure is an estimate from that sample, not the
-- framework's number.
-- reads verl_rollout_corr, verl_rollout_is, prime_rl_mismatch_kl, slime_mismatch and trl_sampling (declared in
-- trustscope/framework_metrics.py).
with verl_corr as (
    unpivot (
        select run_id, step, n_tokens, n_sequences, columns(lambda c: c like 'rollout_corr/%' or c like 'training/%')
        from verl_rollout_corr
    )
    on columns(lambda c: c like 'rollout_corr/%' or c like 'training/%')
    into name metric value value
),

verl_is as (
    unpivot (
        select run_id, step, rollout_is, n_tokens, n_sequences, columns(lambda c: c like 'rollout_corr/%')
        from verl_rollout_is
    )
    on columns(lambda c: c like 'rollout_corr/%')
    into name metric value value
),

prime_rl as (
    unpivot (
        select run_id, step, env, n_tokens, mean, median, std, min, max
        from prime_rl_mismatch_kl
    )
    on mean, median, std, min, max
    into name stat value value
),

trl_figures as (
    unpivot (
        select run_id, step, vllm_importance_sampling_mode, n_tokens, n_sequences,
            columns(lambda c: c like 'sampling/%')
        from trl_sampling
    )
    on columns(lambda c: c like 'sampling/%')
    into name metric value value
),

slime as (
    unpivot (
        select run_id, step, reducer, n_tokens, n_sequences, train_rollout_logprob_abs_diff, tis, tis_clipfrac, tis_abs
        from slime_mismatch
    )
    on train_rollout_logprob_abs_diff, tis, tis_clipfrac, tis_abs
    into name metric value value
),

figures as (
    select run_id, step, 'verl' as framework, metric, null::varchar as variant, value::double as value, n_tokens,
        n_sequences
    from verl_corr
    union all
    select run_id, step, 'verl', metric, 'rollout_is=' || rollout_is, value::double, n_tokens, n_sequences
    from verl_is
    union all
    select run_id, step, 'prime-rl', 'mismatch_kl/' || env || '/' || stat, null, value::double, n_tokens, null
    from prime_rl
    union all
    select run_id, step, 'slime', metric, case when reducer = 'per_token' then 'calculate_per_token_loss' end,
        value::double, n_tokens, n_sequences
    from slime
    union all
    select run_id, step, 'trl', metric, null, value::double, n_tokens, n_sequences
    from trl_figures
    where metric like 'sampling/sampling_logp_difference/%' and vllm_importance_sampling_mode = 'sequence_mask'
    union all
    select run_id, step, 'trl', metric, 'vllm_importance_sampling_mode=' || vllm_importance_sampling_mode,
        value::double, n_tokens, n_sequences
    from trl_figures
    where metric like 'sampling/importance_sampling_ratio/%'
),

logging as (
    select
        run_id,
        try_cast(json_extract(manifest, '$.logging.token_fraction') as double) as token_fraction
    from runs
),

final as (
    select
        f.run_id,
        f.step,
        f.framework,
        f.metric,
        f.variant,
        f.value,
        f.n_tokens::bigint as n_tokens,
        f.n_sequences::bigint as n_sequences,
        coalesce(l.token_fraction, 1.0) >= 1.0 as exact
    from figures as f
    left join logging as l using (run_id)
    order by f.run_id, f.step, f.framework, f.metric, f.variant
)

select * from final
