-- mask family cppo (losses.cppo): dppo's direction test with a position-weighted binary-tv threshold and a
-- cumulative prefix budget. the response's context comes from rule_blocks' window over (run_id, step, rank,
-- sample_id): its length seq_len, the token's position pos among the response's tokens (seq_pos), the p90 of its
-- binary tv and the prefix sums sum_{j<pos} d_j and sum_{j<pos} j d_j. with m = max(seq_len - 1, 1): w = w_min + (1 - w_min) (seq_len - 1 - pos) / m, z = w d,
-- w_prev = sum_{j<pos} w_j = pos w_min + (1 - w_min) / m (pos (seq_len - 1) - pos (pos - 1) / 2),
-- s = sum_{j<pos} w_j d_j = (w_min + (1 - w_min) (seq_len - 1) / m) sum d_j - (1 - w_min) / m sum j d_j,
-- b = clamp(p90, delta_b, 2 delta_b); block where pi moved the way a pushes and z > min(delta, delta + b w_prev - s).
create or replace macro cppo_blocks(pos, seq_len, binary_tv, seq_p90_binary_tv, prefix_binary_tv,
                                    prefix_pos_binary_tv, pi_logprob, mu_logprob, advantage, delta, w_min, delta_b) as
    (w_min + (1 - w_min) * (seq_len - 1 - pos) / clamp_min(seq_len - 1, 1)) * binary_tv
    > least(
        delta,
        delta
        + clamp_max(clamp_min(seq_p90_binary_tv, delta_b), 2 * delta_b)
        * (pos * w_min + (1 - w_min) / clamp_min(seq_len - 1, 1) * (pos * (seq_len - 1) - pos * (pos - 1) / 2))
        - (w_min + (1 - w_min) * (seq_len - 1) / clamp_min(seq_len - 1, 1)) * prefix_binary_tv
        + (1 - w_min) / clamp_min(seq_len - 1, 1) * prefix_pos_binary_tv
    )
    and ((advantage > 0 and pi_logprob > mu_logprob) or (advantage <= 0 and pi_logprob < mu_logprob));
