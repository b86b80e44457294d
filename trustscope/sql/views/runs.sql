-- one row per run: its manifest (run.json) and what its samples table holds so far.
with manifests as (
    select
        content,
        regexp_extract(filename, '([^/\\]+)[/\\]run\.json$', 1) as dir_name
    from read_text(getvariable('trustscope_files').manifests)
    where content <> ''
),

manifest_fields as (
    select
        coalesce(json_extract_string(content, '$.run_id'), dir_name) as run_id,
        json_extract_string(content, '$.status') as status,
        try_cast(json_extract_string(content, '$.schema_version') as integer) as schema_version,
        content::json as manifest
    from manifests
),

sample_stats as (
    select
        run_id,
        count(distinct step) as n_steps,
        min(step) as first_step,
        max(step) as last_step,
        count(*) as n_samples,
        sum(length) as n_response_tokens,
        avg(reward) as mean_reward
    from samples
    group by run_id
),

final as (
    select
        coalesce(m.run_id, s.run_id) as run_id,
        m.status,
        m.schema_version,
        coalesce(s.n_steps, 0) as n_steps,
        s.first_step,
        s.last_step,
        coalesce(s.n_samples, 0) as n_samples,
        coalesce(s.n_response_tokens, 0) as n_response_tokens,
        s.mean_reward,
        m.manifest
    from manifest_fields as m
    full outer join sample_stats as s on m.run_id = s.run_id
    order by run_id
)

select * from final
