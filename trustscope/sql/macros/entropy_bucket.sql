-- entropy bucket (nats) of the rollout distribution at the position; null entropy -> 'unknown'.
create or replace macro entropy_bucket(h) as
    case
        when h is null then 'unknown'
        when h < 0.1 then '1: <0.1'
        when h < 0.5 then '2: 0.1-0.5'
        when h < 1.0 then '3: 0.5-1'
        when h < 2.0 then '4: 1-2'
        else '5: >=2'
    end;
