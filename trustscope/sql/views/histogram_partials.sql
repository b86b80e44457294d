-- mergeable per-file counts behind ratio_vs_divergence: log10 bins of the ratio against each divergence, by mu
-- probability bucket. the bin edges come from analysis_param (ratio_log10_min/max/bins,
-- divergence_log10_min/max/bins). reads rule_blocks (not token_metrics_core) so that the cold pass, which
-- materialises rule_blocks once per file, serves every partial view from the same rows.
with metrics as (
    select
        run_id,
        source_file,
        mu_bucket,
        log_bin(ratio, analysis_param('ratio_log10_min'), analysis_param('ratio_log10_max'),
                analysis_param('ratio_bins')) as ratio_bin,
        log_bin(binary_tv, analysis_param('divergence_log10_min'), analysis_param('divergence_log10_max'),
                analysis_param('divergence_bins')) as binary_tv_bin,
        log_bin(binary_kl, analysis_param('divergence_log10_min'), analysis_param('divergence_log10_max'),
                analysis_param('divergence_bins')) as binary_kl_bin,
        log_bin(topk_tv, analysis_param('divergence_log10_min'), analysis_param('divergence_log10_max'),
                analysis_param('divergence_bins')) as topk_tv_bin,
        log_bin(topk_kl, analysis_param('divergence_log10_min'), analysis_param('divergence_log10_max'),
                analysis_param('divergence_bins')) as topk_kl_bin
    from rule_blocks
),

counts as (
    select
        run_id, source_file, mu_bucket, ratio_bin, binary_tv_bin, binary_kl_bin, topk_tv_bin, topk_kl_bin,
        grouping(binary_tv_bin, binary_kl_bin, topk_tv_bin, topk_kl_bin) as set_id,
        count(*) as n
    from metrics
    group by grouping sets (
        (run_id, source_file, mu_bucket, ratio_bin, binary_tv_bin),
        (run_id, source_file, mu_bucket, ratio_bin, binary_kl_bin),
        (run_id, source_file, mu_bucket, ratio_bin, topk_tv_bin),
        (run_id, source_file, mu_bucket, ratio_bin, topk_kl_bin)
    )
),

final as (
    select
        run_id,
        source_file,
        mu_bucket,
        case set_id when 7 then 'binary_tv' when 11 then 'binary_kl' when 13 then 'topk_tv' else 'topk_kl' end
            as divergence,
        ratio_bin,
        coalesce(binary_tv_bin, binary_kl_bin, topk_tv_bin, topk_kl_bin) as divergence_bin,
        n
    from counts
    -- tokens without stored top-k values have no top-k bin
    where not (set_id = 13 and topk_tv_bin is null) and not (set_id = 14 and topk_kl_bin is null)
)

select * from final
