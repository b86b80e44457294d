-- top-k kl(mu || pi) over mu's top-k ids plus the 'other' bucket (divergence.topk_kl):
-- sum_i p_i log(p_i / q_i) + p_rest log(p_rest / q_rest), >= 0. null lists give null.
create or replace macro topk_kl(mu_topk_logprobs, pi_topk_logprobs) as
    clamp_min(
        list_sum(list_transform(
            mu_topk_logprobs, lambda x, i: exp(x::double) * (x::double - pi_topk_logprobs[i]::double)
        ))
        + topk_rest(mu_topk_logprobs) * (ln(topk_rest(mu_topk_logprobs)) - ln(topk_rest(pi_topk_logprobs))),
        0.0);
