-- rules dppo_binary_tv, dppo_binary_kl, dppo_topk_tv, dppo_topk_kl (losses.dppo): the dppo mask anchored on mu,
-- gating on the divergence named by the rule's `divergence` parameter.
create or replace macro dppo_blocks(divergence, binary_tv, binary_kl, topk_tv, topk_kl,
                                    pi_logprob, mu_logprob, advantage, delta) as
    coalesce(dppo_mask_blocks(
        divergence_by_name(divergence, binary_tv, binary_kl, topk_tv, topk_kl),
        pi_logprob, mu_logprob, advantage, delta
    ), false);
