-- the scale at which mask family negative_mask starts to block a token (masks.negative_mask.score_negative_mask): (mu - pi) /
-- delta on a <= 0 tokens, else null. blocked at scale u: score >= u (the mask's comparison is inclusive).
create or replace macro negative_mask_score(mu_prob, pi_prob, advantage, delta) as
    case when advantage <= 0 then (mu_prob - pi_prob) / nullif(delta, 0) end;
