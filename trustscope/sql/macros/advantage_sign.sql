-- sign of the advantage as a label: positive, zero or negative.
create or replace macro advantage_sign(a) as
    case when a > 0 then 'positive' when a < 0 then 'negative' else 'zero' end;
