-- probability bucket of the sampled token under mu (labels sort in probability order).
create or replace macro mu_bucket(p) as
    case
        when p < 0.001 then '1: <0.001'
        when p < 0.01 then '2: 0.001-0.01'
        when p < 0.1 then '3: 0.01-0.1'
        when p < 0.5 then '4: 0.1-0.5'
        when p < 0.9 then '5: 0.5-0.9'
        else '6: >=0.9'
    end;
