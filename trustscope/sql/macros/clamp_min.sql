-- max(x, lo) that keeps null as null (duckdb's greatest() skips nulls, which would turn a missing value into lo).
create or replace macro clamp_min(x, lo) as
    case when x < lo then lo else x end;
