-- lower edge (in linear units) of log10 bin b among n equal bins over [10^lo, 10^hi].
create or replace macro log_bin_edge(b, lo, hi, n) as
    pow(10, lo + b * (hi - lo) / n);
