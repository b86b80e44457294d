-- min(x, hi) that keeps null as null (duckdb's least() skips nulls, which would turn a missing value into hi).
create or replace macro clamp_max(x, hi) as
    case when x > hi then hi else x end;
