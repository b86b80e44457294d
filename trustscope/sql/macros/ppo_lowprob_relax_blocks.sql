-- rule ppo_lowprob_relax (losses.ppo_lowprob_relax): the ppo clip, but a side is never clipped for tokens
-- with mu < alpha (alpha_high for the a > 0 side, alpha_low for the a < 0 side).
create or replace macro ppo_lowprob_relax_blocks(pi_logprob, mu_logprob, advantage, eps_low, eps_high,
                                                 alpha_low, alpha_high) as
    (advantage > 0 and ratio(pi_logprob, mu_logprob) > 1 + eps_high and exp(mu_logprob::double) >= alpha_high)
    or (advantage < 0 and ratio(pi_logprob, mu_logprob) < 1 - eps_low and exp(mu_logprob::double) >= alpha_low);
