-- a summary dimension's bucket as a label: positions as their power-of-two range ('0', '1', '2-3', '4-7', ...),
-- the other dimensions (turn, staleness) as their value; null outside a dimension.
create or replace macro bucket_label(dimension, bucket) as
    case
        when dimension = 'position' then position_bucket_label(bucket)
        when dimension is not null then bucket::varchar
    end;
