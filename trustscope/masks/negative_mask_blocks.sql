-- mask family negative_mask (losses.minimal_negative_mask, "mask-delta"): block only a <= 0 tokens that pi pushed
-- down from mu by at least delta (inclusive).
create or replace macro negative_mask_blocks(mu_prob, pi_prob, advantage, delta) as
    advantage <= 0 and mu_prob - pi_prob >= delta;
