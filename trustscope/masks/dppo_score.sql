-- the scale at which mask family dppo starts to block a token (masks.family.Threshold, masks.dppo.score_dppo): d / delta where
-- pi moved past the anchor the way the advantage pushes, else null (never blocked). blocked at scale u: score > u.
create or replace macro dppo_score(binary_tv, binary_kl, topk_tv, topk_kl, pi_logprob, anchor_logprob, advantage,
                                   divergence, delta) as
    case
        when (advantage > 0 and pi_logprob > anchor_logprob) or (advantage <= 0 and pi_logprob < anchor_logprob)
            then divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl) / nullif(delta, 0)
    end;
