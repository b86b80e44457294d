-- the scale at which mask family ratio_band starts to block a token (masks.ratio_band.score_ratio_band): with both bounds
-- scaled in log (low ** u, high ** u), max(ln r / ln high, ln r / ln low). blocked at scale u: score > u.
create or replace macro ratio_band_score(r, low, high) as
    case
        when r <= 0 then 'inf'::double
        else greatest(ln(r) / nullif(ln(high), 0), ln(r) / nullif(ln(low), 0))
    end;
