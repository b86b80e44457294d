-- the scale at which mask family ratio_clip starts to block a token (masks.ratio_clip.score_ratio_clip): (r - 1) / eps_high
-- for a > 0, (1 - r) / eps_low for a <= 0 (eps_low keeps its proportion to eps_high); dual-clip's block (a <= 0,
-- r > c) at every scale (inf). blocked at scale u: score > u.
create or replace macro ratio_clip_score(r, advantage, eps_low, eps_high, dual_clip) as
    case
        when coalesce(advantage <= 0 and r > dual_clip, false) then 'inf'::double
        when advantage > 0 then (r - 1) / nullif(eps_high, 0)
        else (1 - r) / nullif(eps_low, 0)
    end;
