-- mask family ratio_clip (losses.RATIO_CLIP_MU on r = pi / mu: ppo_clip, grpo; RATIO_CLIP_OLD on pi / pi_old:
-- minirl, minirl_tis): ppo's mask, and with dual_clip (c > 1, null = off) also a <= 0 tokens with r > c.
create or replace macro ratio_clip_blocks(r, advantage, eps_low, eps_high, dual_clip) as
    ppo_mask_blocks(r, advantage, eps_low, eps_high)
    or coalesce(advantage <= 0 and r > dual_clip, false);
