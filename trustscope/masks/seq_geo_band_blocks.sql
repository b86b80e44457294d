-- mask family seq_geo_band (losses.geo_mask): block the whole response when the geometric mean of r = pi / mu over
-- it (exp of seq_log_ratio, from rule_blocks' window over (run_id, step, rank, sample_id)) leaves [low, high].
create or replace macro seq_geo_band_blocks(seq_log_ratio, low, high) as
    ratio_band_blocks(exp(seq_log_ratio), low, high);
