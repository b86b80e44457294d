-- the exact per-step summaries (written by the logger over every token, whatever token_fraction kept), merged
-- over the micro-batches of a step and the ranks of a run: one row per (run, step, metric, group). derived:
-- mean = sum / count; fraction = count over the step's tokens of the same advantage sign and mu bucket (metrics
-- blocked, trainer_blocked) or over all the step's tokens (the rest); for histogram rows (metric '<x>_hist')
-- cum_fraction = the share of values below bin_high, so the q-quantile is the bin_high of the first bin with
-- cum_fraction >= q (exact to bin resolution). mu_bucket labels the bucket with the mu_bucket macro.
-- rows with a dimension (position, turn, staleness) split the same metrics by that dimension's bucket instead of
-- the mu bucket (bucket: its lower edge, bucket_label: its label); their fractions are over the tokens of the same
-- dimension, bucket and sign. step_tokens counts the step's tokens once (from the rows without a dimension).
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').summaries, union_by_name = true)
),

merged as (
    select
        run_id,
        step,
        metric,
        rule,
        advantage_sign,
        mu_low,
        bin_low,
        bin_high,
        threshold,
        dimension,
        bucket,
        sum(count)::bigint as count,
        sum(sum) as sum,
        sum(sum_sq) as sum_sq,
        min(min) as min,
        max(max) as max
    from source
    group by all
),

groups as (
    select run_id, step, dimension, bucket, advantage_sign, mu_low, sum(count)::bigint as group_tokens
    from merged
    where metric = 'tokens'
    group by all
),

totals as (
    select run_id, step, sum(group_tokens)::bigint as step_tokens
    from groups
    where dimension is null
    group by all
),

bucket_totals as (
    select run_id, step, dimension, bucket, sum(group_tokens)::bigint as bucket_tokens
    from groups
    where dimension is not null
    group by all
),

final as (
    select
        m.run_id,
        m.step,
        m.metric,
        m.rule,
        m.advantage_sign,
        case when m.mu_low is not null then mu_bucket(m.mu_low) end as mu_bucket,
        m.mu_low,
        m.bin_low,
        m.bin_high,
        m.threshold,
        m.dimension,
        m.bucket,
        bucket_label(m.dimension, m.bucket) as bucket_label,
        m.count,
        m.sum,
        m.sum_sq,
        m.min,
        m.max,
        m.sum / nullif(m.count, 0) as mean,
        case
            when m.metric in ('blocked', 'trainer_blocked') then m.count / nullif(g.group_tokens, 0)
            when m.metric like '%\_hist' escape '\' then m.count / nullif(sum(m.count) over hist, 0)
            when m.dimension is not null then m.count / nullif(d.bucket_tokens, 0)
            else m.count / nullif(t.step_tokens, 0)
        end as fraction,
        case
            when m.metric like '%\_hist' escape '\'
                then sum(m.count) over (hist order by m.bin_low) / nullif(sum(m.count) over hist, 0)
        end as cum_fraction,
        t.step_tokens
    from merged as m
    left join groups as g
        on g.run_id = m.run_id and g.step = m.step and g.advantage_sign = m.advantage_sign
        and g.mu_low is not distinct from m.mu_low and g.dimension is not distinct from m.dimension
        and g.bucket is not distinct from m.bucket
    left join totals as t on t.run_id = m.run_id and t.step = m.step
    left join bucket_totals as d
        on d.run_id = m.run_id and d.step = m.step and d.dimension = m.dimension and d.bucket = m.bucket
    window hist as (partition by m.run_id, m.step, m.metric, m.dimension, m.bucket)
    order by m.run_id, m.step, m.dimension nulls first, m.bucket, m.metric, m.rule, m.advantage_sign, m.mu_low,
        m.bin_low
)

select * from final
