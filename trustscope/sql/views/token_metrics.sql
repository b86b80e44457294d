-- per-token metrics with the token's text from the run's vocabulary.
with metrics as (
    select * from token_metrics_core
),

texts as (
    select run_id, token_id, text as token_text from vocab
),

final as (
    select metrics.*, texts.token_text
    from metrics
    left join texts using (run_id, token_id)
)

select * from final
