-- mu against pi at the logged alignment and shifted one position either way inside each response, per run. a log
-- whose mu and pi are off by one fits far better shifted than as logged (the table macro pi_shifted). $run_ids: the
-- runs read, or null for all; $first_step: the first step read, or null for all.
with shifted as (
    select * from pi_shifted($run_ids, $first_step, false)
),

final as (
    select
        run_id,
        count(*) as n_tokens,
        avg(abs(pi_prob - mu_prob)) as diff_logged,
        count(pi_later) as n_pairs,
        avg(abs(pi_later - mu_prob)) as diff_pi_later,
        avg(abs(pi_earlier - mu_prob)) as diff_pi_earlier,
        corr(mu_prob, pi_prob) as corr_logged,
        corr(mu_prob, pi_later) as corr_pi_later,
        corr(mu_prob, pi_earlier) as corr_pi_earlier,
        max_by(
            {'step': step, 'sample_id': sample_id, 'pos': pos, 'mu_prob': mu_prob, 'pi_prob': pi_prob,
             'pi_prob_next_pos': pi_later, 'pi_prob_previous_pos': pi_earlier},
            abs(pi_prob - mu_prob), 3
        ) as examples
    from shifted
    group by run_id
)

select * from final order by run_id
