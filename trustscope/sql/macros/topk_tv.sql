-- top-k tv over mu's top-k ids plus the 'other' bucket (divergence.topk_tv):
-- 0.5 * (sum_i |p_i - q_i| + |p_rest - q_rest|), in [0, 1]. the lists are aligned by token id; null gives null.
create or replace macro topk_tv(mu_topk_logprobs, pi_topk_logprobs) as
    clamp_max(clamp_min(
        0.5 * (
            list_sum(list_transform(
                mu_topk_logprobs, lambda x, i: abs(exp(x::double) - exp(pi_topk_logprobs[i]::double))
            ))
            + abs(topk_rest(mu_topk_logprobs) - topk_rest(pi_topk_logprobs))
        ),
        0.0), 1.0);
