-- mask family lowprob_relax (losses.ppo_lowprob_relax): ppo's clip on r = pi / mu, but a side is never clipped
-- for tokens with mu < alpha (alpha_high for the a > 0 side, alpha_low for the a <= 0 side).
create or replace macro lowprob_relax_blocks(r, mu_prob, advantage, eps_low, eps_high, alpha_low, alpha_high) as
    (advantage > 0 and r > 1 + eps_high and mu_prob >= alpha_high)
    or (advantage <= 0 and r < 1 - eps_low and mu_prob >= alpha_low);
