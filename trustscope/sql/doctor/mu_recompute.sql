-- how often mu equals pi (and pi_old) exactly and to within $same nats, per run, among tokens whose mu is below $informative
-- (near-certain tokens read 0 in every engine and say nothing). a mu equal to the trainer's own log-prob is a
-- recompute: no training-inference mismatch was measured. $run_ids: the runs read, or null for all; $first_step:
-- the first step read, or null for all.
with source as (
    select run_id, step, sample_id, pos, mu_logprob, old_logprob, pi_logprob
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
        and mu_logprob < $informative
),

final as (
    select
        run_id,
        count(*) as n_informative,
        count_if(mu_logprob = pi_logprob) as n_exact_pi,
        count_if(abs(mu_logprob - pi_logprob) <= $same) as n_same_pi,
        count(old_logprob) as n_informative_old,
        count_if(mu_logprob = old_logprob) as n_exact_old,
        count_if(abs(mu_logprob - old_logprob) <= $same) as n_same_old,
        avg(abs(exp(pi_logprob::double) - exp(mu_logprob::double))) as mismatch_mean,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'mu_logprob': mu_logprob,
                'old_logprob': old_logprob, 'pi_logprob': pi_logprob}, -pos, 3) as examples
    from source
    group by run_id
)

select * from final order by run_id
