-- one row per response: prompt and response text, reward, advantage, length, finish reason.
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').samples, union_by_name = true, filename = true)
),

final as (
    select * exclude (filename), filename as source_file
    from source
)

select * from final
