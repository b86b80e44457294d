-- mask family dppo (losses.DPPO_MU: dppo_binary_tv/kl, dppo_topk_tv/kl; DPPO_OLD: dppo_decoupled, with the
-- divergences and the anchor taken against pi_old): gate on the divergence named by `divergence`.
create or replace macro dppo_blocks(binary_tv, binary_kl, topk_tv, topk_kl, pi_logprob, anchor_logprob, advantage,
                                    divergence, delta) as
    dppo_mask_blocks(
        divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl),
        pi_logprob, anchor_logprob, advantage, delta
    );
