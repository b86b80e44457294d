-- how many tokens that carry gradient (a <> 0) of run $run_id each rule with a scalar threshold starts to block in
-- each bin of scale (the bins of the logger's threshold_hist summaries: 8 a decade from 1e-6, [0, 1e-6) first,
-- [1e6, inf) last), from the logged rows: the rule at scale u blocks the tokens of every bin above u (curves of
-- blocked share against threshold). the score columns are read in long form (the table macro rule_scores).
with binned as (
    select
        rule_column,
        case
            when score < 1e-6 then -49
            when score >= 1e6 then 48
            else floor(log10(score) * 8)::integer
        end as bin
    from rule_scores($run_id)
    where score > 0
),

final as (
    select
        substr(rule_column, 7) as rule,
        case when bin = -49 then 0.0 else pow(10.0, bin / 8.0) end as bin_low,
        case when bin = 48 then 'inf'::double else pow(10.0, (bin + 1) / 8.0) end as bin_high,
        count(*)::bigint as count
    from binned
    group by all
    order by rule, bin_low
)

select * from final
