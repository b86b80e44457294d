-- mask family seq_geo_band (losses.geo_mask): block the whole response when the geometric mean of r = pi / mu over
-- its window (run_id, step, rank, sample_id) leaves [low, high].
create or replace macro seq_geo_band_blocks(run_id, step, rank, sample_id, pos, log_ratio, low, high) as
    ratio_band_blocks(exp(avg(log_ratio) over (partition by run_id, step, rank, sample_id)), low, high);
