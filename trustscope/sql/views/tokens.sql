-- one row per logged response token, over every run of the log directory. the file list holds the runs'
-- tokens/*.parquet globs: only whole files are seen (the logger writes temporary names, then renames).
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').tokens, union_by_name = true, filename = true)
),

final as (
    select * exclude (filename), filename as source_file
    from source
)

select * from final
