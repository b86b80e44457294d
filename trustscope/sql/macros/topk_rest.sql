-- the 'other' bucket of a top-k list of logprobs: 1 - sum of the k probabilities, clamped at 1e-12; null stays null.
create or replace macro topk_rest(topk_logprobs) as
    clamp_min(1.0 - list_sum(list_transform(topk_logprobs, lambda x: exp(x::double))), 1e-12);
