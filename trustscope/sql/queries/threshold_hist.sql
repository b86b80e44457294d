-- each rule's threshold histogram over every step of the runs in $run_ids (the logger's threshold_hist
-- summaries, over every token with a <> 0, read straight from the summaries files: the summaries view's merge
-- and fractions are not needed to add counts up): per (run, rule, bin of scale) the tokens the rule starts to
-- block there, for the equal-budget solve and the threshold curves (one query for every run, not one a run).
with hist as (
    select run_id, rule, bin_low, bin_high, count
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
    where metric = 'threshold_hist' and dimension is null and list_contains($run_ids::varchar[], run_id)
),

final as (
    select run_id, rule, bin_low, bin_high, sum(count)::bigint as count
    from hist
    group by all
    order by run_id, rule, bin_low
)

select * from final
