-- the scale at which mask family seq_geo_band starts to block a response (masks.seq_geo_band.score_seq_geo_band): ratio_band's
-- score on the geometric-mean ratio, whose log is seq_log_ratio.
create or replace macro seq_geo_band_score(seq_log_ratio, low, high) as
    greatest(seq_log_ratio / nullif(ln(high), 0), seq_log_ratio / nullif(ln(low), 0));
