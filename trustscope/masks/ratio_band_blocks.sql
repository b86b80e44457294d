-- mask family ratio_band (losses.token_mis, icepop): block a token whose r = pi / mu leaves [low, high], whatever
-- the advantage's sign.
create or replace macro ratio_band_blocks(r, low, high) as
    r < low or r > high;
