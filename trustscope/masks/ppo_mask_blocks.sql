-- ppo's mask on a ratio r (masks.family.ppo_keep) as a "would block" predicate: block a > 0 with r > 1 + eps_high, and
-- a <= 0 with r < 1 - eps_low (a = 0 takes the negative branch, as in dppo). null r gives null.
create or replace macro ppo_mask_blocks(r, advantage, eps_low, eps_high) as
    (advantage > 0 and r > 1 + eps_high) or (advantage <= 0 and r < 1 - eps_low);
