-- prime-rl's own mismatch figure, mismatch_kl/{env}/{mean,median,std,min,max}, one row per (run, step, env): the
-- per-token k3 estimator exp(l) - l - 1 with l = log pi_train - log mu (prime_rl/trainer/rl/loss.py
-- compute_importance_ratio_and_mismatch_kl), over the loss_mask tokens of every micro-step and rank of the step
-- (train.py's mismatch_mask; the rows the importer writes), reduced as prime_rl/trainer/utils.py
-- Tensors.compute_stats does: mean, median (torch.median: the lower middle value), sample std, min, max.
-- training side: pi_logprob (prime-rl's trainer_logprobs); rollout side: mu_logprob. env 'all' is every row; a run
-- with a column env (TokenLogger(extra_columns={'env': 'string'})) gets a row per environment too, as prime-rl's
-- mismatch_kl/<env_name>. declared in trustscope/framework_metrics.py.
with source as (
    select * from (
        select columns(lambda c: c in ('run_id', 'step', 'mu_logprob', 'pi_logprob', 'env'))
        from tokens
        union all by name
        select null::varchar as env
        where false
    )
),

per_token as (
    select
        run_id,
        step,
        env::varchar as env,
        exp(pi_logprob::double - mu_logprob::double) - (pi_logprob::double - mu_logprob::double) - 1.0
            as mismatch_kl
    from source
),

every_row as (
    select run_id, step, 'all' as env, mismatch_kl
    from per_token
),

per_env as (
    select run_id, step, env, mismatch_kl
    from per_token
    where env is not null
),

rows_by_env as (
    select * from every_row
    union all
    select * from per_env
),

final as (
    select
        run_id,
        step,
        env,
        count(*) as n_tokens,
        avg(mismatch_kl) as mean,
        quantile_disc(mismatch_kl, 0.5) as median,
        stddev_samp(mismatch_kl) as std,
        min(mismatch_kl) as min,
        max(mismatch_kl) as max
    from rows_by_env
    group by run_id, step, env
    order by run_id, step, env
)

select * from final
