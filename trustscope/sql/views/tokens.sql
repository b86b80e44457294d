-- one row per logged response token, over every run of the log directory. the file list holds the runs'
-- tokens/*.parquet globs: only whole files are seen (the logger writes temporary names, then renames).
-- staleness = step - policy_version: how many weight updates the engine that sampled the token was behind the
-- trainer (null where the version is unknown, as in files written before policy_version). a run's own columns
-- (TokenLogger(extra_columns=...)) come after the built-in ones, null in the other runs.
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').tokens, union_by_name = true, filename = true)
),

final as (
    select * exclude (filename), filename as source_file, step - policy_version as staleness
    from source
)

select * from final
