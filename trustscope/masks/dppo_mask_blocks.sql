-- dppo's mask (masks.family.dppo_keep) as a "would block" predicate: block only where the divergence is over delta
-- and pi already moved past the anchor the way the advantage pushes (a = 0 falls in the negative branch).
create or replace macro dppo_mask_blocks(div, pi_logprob, anchor_logprob, advantage, delta) as
    div > delta
    and (
        (advantage > 0 and pi_logprob > anchor_logprob)
        or (advantage <= 0 and pi_logprob < anchor_logprob)
    );
