-- rules minirl and minirl_tis (losses.minirl): the ppo mask on pi / pi_old (decoupled, anchored on the
-- recomputed pi_old). a token without pi_old is never blocked (null -> false).
create or replace macro minirl_blocks(pi_logprob, old_logprob, advantage, eps_low, eps_high) as
    coalesce(ppo_mask_blocks(ratio(pi_logprob, old_logprob), advantage, eps_low, eps_high), false);
