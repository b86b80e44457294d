-- the scale at which mask family drpo counts a token as blocked (masks.drpo.score_drpo): sign(a) (pi - mu) / delta,
-- sign(a) = -1 for a <= 0. blocked at scale u: score >= u (inclusive, as drpo_blocks).
create or replace macro drpo_score(pi_prob, mu_prob, advantage, delta) as
    case when advantage > 0 then pi_prob - mu_prob else mu_prob - pi_prob end / nullif(delta, 0);
