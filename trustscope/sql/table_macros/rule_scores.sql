-- the scores of run `run`'s tokens that carry gradient (a <> 0) in long form, one row per token and rule with a
-- scalar threshold: rule_column (score_<rule>, from rule_blocks) and score. what equal_budget_cut and
-- threshold_counts count.
create or replace macro rule_scores(run) as table
    unpivot (
        select columns('^score_.*$')
        from rule_blocks
        where run_id = run and advantage <> 0
    )
    on columns('^score_.*$')
    into name rule_column value score;
