-- mask family none (losses.NO_MASK: pg_is, cispo, token_tis): no trust-region mask, never blocks.
create or replace macro none_blocks() as
    false;
