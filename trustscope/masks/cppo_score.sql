-- the scale at which mask family cppo starts to block a token (masks.cppo.score_cppo): cppo_blocks compares z = w d
-- with min(delta, delta + b w_prev - s) = delta + min(0, b w_prev - s), so the scale is (z - min(0, b w_prev - s))
-- / delta where pi moved the way a pushes (w_min and delta_b stay). same terms as cppo_blocks.
create or replace macro cppo_score(pos, seq_len, binary_tv, seq_p90_binary_tv, prefix_binary_tv,
                                   prefix_pos_binary_tv, pi_logprob, mu_logprob, advantage, delta, w_min, delta_b) as
    case
        when (advantage > 0 and pi_logprob > mu_logprob) or (advantage <= 0 and pi_logprob < mu_logprob) then (
            (w_min + (1 - w_min) * (seq_len - 1 - pos) / clamp_min(seq_len - 1, 1)) * binary_tv
            - least(
                0.0,
                clamp_max(clamp_min(seq_p90_binary_tv, delta_b), 2 * delta_b)
                * (pos * w_min + (1 - w_min) / clamp_min(seq_len - 1, 1) * (pos * (seq_len - 1) - pos * (pos - 1) / 2))
                - (w_min + (1 - w_min) * (seq_len - 1) / clamp_min(seq_len - 1, 1)) * prefix_binary_tv
                + (1 - w_min) / clamp_min(seq_len - 1, 1) * prefix_pos_binary_tv
            )
        ) / nullif(delta, 0)
    end;
