-- mu's top-k lists against their contract, per run: the sampled token is among the ids, no id twice in a row, and
-- the probabilities of mu's (and pi's) list sum to at most 1 + $tolerance. $run_ids: the runs read, or null for
-- all; $first_step: the first step read, or null for all.
with source as (
    select run_id, step, sample_id, pos, token_id, mu_topk_ids, mu_topk_logprobs, pi_topk_logprobs
    from tokens
    where ($run_ids::varchar[] is null or list_contains($run_ids::varchar[], run_id))
        and ($first_step::bigint is null or step >= $first_step::bigint)
),

per_row as (
    select
        *,
        not list_contains(mu_topk_ids, token_id) as missing_sampled,
        -- an id whose first position comes before its own: vectorised, about 5x faster than list_distinct here.
        list_bool_or(list_transform(mu_topk_ids, lambda x, i: list_position(mu_topk_ids, x) < i)) as has_duplicates,
        list_sum(list_transform(mu_topk_logprobs, lambda x: exp(x::double))) as mu_mass,
        list_sum(list_transform(pi_topk_logprobs, lambda x: exp(x::double))) as pi_mass
    from source
),

final as (
    select
        run_id,
        count(*) as n_tokens,
        count(mu_topk_ids) as n_topk,
        max(len(mu_topk_ids)) as k,
        count_if(missing_sampled) as n_missing_sampled,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'token_id': token_id, 'mu_topk_ids': mu_topk_ids},
               pos, 3) filter (where missing_sampled) as missing_examples,
        count_if(has_duplicates) as n_duplicates,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'mu_topk_ids': mu_topk_ids},
               pos, 3) filter (where has_duplicates)
            as duplicate_examples,
        count(pi_topk_logprobs) as n_pi_topk,
        count_if(mu_mass > 1 + $tolerance) as n_mu_over,
        count_if(pi_mass > 1 + $tolerance) as n_pi_over,
        max(mu_mass) as mu_mass_max,
        max(pi_mass) as pi_mass_max,
        max_by({'step': step, 'sample_id': sample_id, 'pos': pos, 'mu_mass': mu_mass, 'pi_mass': pi_mass},
               greatest(mu_mass, coalesce(pi_mass, 0)), 3)
            filter (where mu_mass > 1 + $tolerance or pi_mass > 1 + $tolerance) as mass_examples
    from per_row
    group by run_id
)

select * from final order by run_id
