-- mask family drpo (losses.drpo): drpo has no hard mask; a token counts as blocked where its gradient weight
-- g = 1 - sign(a) (pi - mu) / delta is <= 0 (sign(a) = -1 for a <= 0): the penalty has cancelled or reversed the
-- push, at or beyond the dppo boundary in the harmful direction.
create or replace macro drpo_blocks(pi_prob, mu_prob, advantage, delta) as
    (advantage > 0 and pi_prob - mu_prob >= delta) or (advantage <= 0 and mu_prob - pi_prob >= delta);
