-- rules ppo_clip and grpo (losses.ppo_clip): the ppo mask on r = pi / mu. dual_clip and is_cap change the
-- weight only, never the mask.
create or replace macro ppo_clip_blocks(pi_logprob, mu_logprob, advantage, eps_low, eps_high) as
    ppo_mask_blocks(ratio(pi_logprob, mu_logprob), advantage, eps_low, eps_high);
