-- token id -> text of every run; the run id is the name of the directory holding vocab.parquet.
with source as (
    select *
    from read_parquet(getvariable('trustscope_files').vocab, union_by_name = true, filename = true)
),

final as (
    select
        regexp_extract(filename, '([^/\\]+)[/\\]vocab\.parquet$', 1) as run_id,
        token_id,
        text
    from source
    where regexp_extract(filename, '([^/\\]+)[/\\]vocab\.parquet$', 1) <> ''
)

select * from final
