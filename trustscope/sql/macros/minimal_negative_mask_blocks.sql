-- rule minimal_negative_mask (losses.minimal_negative_mask, "mask-delta"): block only negative-advantage tokens
-- that pi pushed down from mu by at least delta.
create or replace macro minimal_negative_mask_blocks(pi_logprob, mu_logprob, advantage, delta) as
    advantage < 0 and exp(mu_logprob::double) - exp(pi_logprob::double) >= delta;
