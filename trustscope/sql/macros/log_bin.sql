-- index of the log10 bin of x among n equal bins over [10^lo, 10^hi]; values outside land in the end bins,
-- zeros and negatives in bin 0, null stays null.
create or replace macro log_bin(x, lo, hi, n) as
    clamp_max(clamp_min(floor((log10(clamp_min(x, 1e-300)) - lo) / ((hi - lo) / n)), 0), n - 1)::integer;
