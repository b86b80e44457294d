-- the lower edge of a response position's power-of-two bucket: 0, 1, 2 (2-3), 4 (4-7), 8 (8-15), ... (the summary
-- dimension 'position', trustscope/columns.py: the logger computes the same in numpy).
create or replace macro position_bucket(pos) as
    case when pos < 1 then 0::bigint else pow(2, floor(log2(pos)))::bigint end;
