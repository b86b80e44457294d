-- mask family cppo (losses.cppo): dppo's direction test with a position-weighted threshold and a prefix budget
-- over the response's window (run_id, step, rank, sample_id), positions pos = 0 .. L-1. the weight is
-- w_t = 1 - (1 - w_min) t / (L - 1); block where pi moved the way a pushes and w_t d_t > delta or the running
-- weighted mean (1 / (t + 1)) sum_{s <= t} w_s d_s > budget. the weighted prefix sum is written as
-- sum d_s - (1 - w_min) / (L - 1) sum s d_s, so no window nests in another.
create or replace macro cppo_blocks(run_id, step, rank, sample_id, pos, binary_tv, binary_kl, topk_tv, topk_kl,
                                    pi_logprob, mu_logprob, advantage, divergence, delta, w_min, budget) as
    (
        (1 - (1 - w_min) * pos / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1))
            * divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl) > delta
        or (
            sum(divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)) over (
                partition by run_id, step, rank, sample_id order by pos rows between unbounded preceding and current row
            )
            - (1 - w_min) / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1)
            * sum(pos * divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)) over (
                partition by run_id, step, rank, sample_id order by pos rows between unbounded preceding and current row
            )
        ) / (pos + 1) > budget
    )
    and ((advantage > 0 and pi_logprob > mu_logprob) or (advantage <= 0 and pi_logprob < mu_logprob));
