-- the scale at which mask family lowprob_relax starts to block a token (masks.lowprob_relax.score_lowprob_relax): ppo's clip as
-- in ratio_clip_score, each side only where mu >= that side's alpha (else null: never blocked).
create or replace macro lowprob_relax_score(r, mu_prob, advantage, eps_low, eps_high, alpha_low, alpha_high) as
    case
        when advantage > 0 and mu_prob >= alpha_high then (r - 1) / nullif(eps_high, 0)
        when advantage <= 0 and mu_prob >= alpha_low then (1 - r) / nullif(eps_low, 0)
    end;
