-- binned 2-d histogram of the ratio r against each divergence (binary/top-k tv and kl), by mu probability
-- bucket: the paper's ratio-versus-divergence picture, ready to plot (log10 bins, edges in linear units).
-- reads the kept per-file counts (histogram_partials_cache), filled by trustscope.db before each query.
with partials as (
    select * from histogram_partials_cache
),

counts as (
    select run_id, mu_bucket, divergence, ratio_bin, divergence_bin, sum(n)::bigint as n
    from partials
    group by all
),

final as (
    select
        run_id,
        mu_bucket,
        divergence,
        ratio_bin,
        log_bin_edge(ratio_bin, analysis_param('ratio_log10_min'), analysis_param('ratio_log10_max'),
                     analysis_param('ratio_bins')) as ratio_lo,
        log_bin_edge(ratio_bin + 1, analysis_param('ratio_log10_min'), analysis_param('ratio_log10_max'),
                     analysis_param('ratio_bins')) as ratio_hi,
        divergence_bin,
        log_bin_edge(divergence_bin, analysis_param('divergence_log10_min'),
                     analysis_param('divergence_log10_max'), analysis_param('divergence_bins')) as divergence_lo,
        log_bin_edge(divergence_bin + 1, analysis_param('divergence_log10_min'),
                     analysis_param('divergence_log10_max'), analysis_param('divergence_bins')) as divergence_hi,
        n
    from counts
    order by run_id, divergence, mu_bucket, ratio_bin, divergence_bin
)

select * from final
