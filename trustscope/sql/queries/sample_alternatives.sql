-- mu's top-k alternatives of every logged token of one response (run $run_id, step $step, sample $sample_id):
-- their texts, mu's and pi's probabilities of each (pi at the same token ids) and the rank of the sampled token
-- among them, in rank order.
with topk as (
    select pos, token_id, mu_topk_ids, mu_topk_logprobs, pi_topk_logprobs
    from tokens
    where run_id = $run_id and step = $step and sample_id = $sample_id
),

alternatives_long as (
    select
        pos,
        token_id,
        unnest(mu_topk_ids) as alt_id,
        unnest(mu_topk_logprobs) as alt_logprob,
        unnest(coalesce(pi_topk_logprobs, [])) as alt_pi_logprob,
        unnest(range(len(mu_topk_ids))) as k
    from topk
),

texts as (
    select token_id, text from vocab where run_id = $run_id
),

final as (
    select
        alternatives_long.pos,
        list(coalesce(texts.text, '#' || alternatives_long.alt_id::varchar) order by k) as alt_texts,
        list(exp(alt_logprob::double) order by k) as alt_probs,
        list(exp(alt_pi_logprob::double) order by k) filter (where alt_pi_logprob is not null) as alt_pi_probs,
        list_position(list(alt_id order by k), any_value(alternatives_long.token_id)) as sampled_rank
    from alternatives_long
    left join texts on texts.token_id = alternatives_long.alt_id
    group by alternatives_long.pos
    order by alternatives_long.pos
)

select * from final
