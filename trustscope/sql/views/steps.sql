-- long-form step scalars (reward, loss, lr, timings, grad norm, ...): run_id, step, rank, name, value.
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').steps, union_by_name = true, filename = true)
),

final as (
    select * exclude (filename), filename as source_file
    from source
)

select * from final
