-- mask family cppo (losses.cppo): dppo's direction test with a position-weighted threshold and a cumulative prefix
-- budget over the response's window (run_id, step, rank, sample_id), positions pos = 0 .. L-1:
-- w = w_min + (1 - w_min) (L - 1 - pos) / max(L - 1, 1), z = w d, prefix sums s = sum_{j<pos} z_j and
-- w_prev = sum_{j<pos} w_j, the response's budget b = clamp(p90(d), delta_b, 2 delta_b); block where pi moved the
-- way a pushes and z > min(delta, delta + b w_prev - s). the prefix sums are written in closed form over
-- sum d_j and sum j d_j, so no window nests in another.
create or replace macro cppo_blocks(run_id, step, rank, sample_id, pos, binary_tv, binary_kl, topk_tv, topk_kl,
                                    pi_logprob, mu_logprob, advantage, divergence, delta, w_min, delta_b) as
    (
        (w_min + (1 - w_min) * (count(*) over (partition by run_id, step, rank, sample_id) - 1 - pos)
            / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1))
        * divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)
        > least(
            delta,
            delta
            + clamp_max(clamp_min(
                quantile_cont(divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)::double, 0.9)
                    over (partition by run_id, step, rank, sample_id),
                delta_b), 2 * delta_b)
            * (pos * w_min + (1 - w_min)
               / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1)
               * (pos * (count(*) over (partition by run_id, step, rank, sample_id) - 1) - pos * (pos - 1) / 2))
            - coalesce(
                (w_min + (1 - w_min) * (count(*) over (partition by run_id, step, rank, sample_id) - 1)
                    / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1))
                * sum(divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)) over (
                    partition by run_id, step, rank, sample_id order by pos
                    rows between unbounded preceding and 1 preceding)
                - (1 - w_min) / clamp_min(count(*) over (partition by run_id, step, rank, sample_id) - 1, 1)
                * sum(pos * divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl)) over (
                    partition by run_id, step, rank, sample_id order by pos
                    rows between unbounded preceding and 1 preceding),
                0.0)
        )
    )
    and ((advantage > 0 and pi_logprob > mu_logprob) or (advantage <= 0 and pi_logprob < mu_logprob));
