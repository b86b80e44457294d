-- rule dppo_decoupled (losses.dppo_decoupled): the dppo mask anchored on the recomputed pi_old, with binary
-- tv or kl between pi_old and pi. a token without pi_old is never blocked.
create or replace macro dppo_decoupled_blocks(divergence, pi_logprob, old_logprob, advantage, delta) as
    coalesce(dppo_mask_blocks(
        divergence_by_name(
            divergence, binary_tv(old_logprob, pi_logprob), binary_kl(old_logprob, pi_logprob), null, null
        ),
        pi_logprob, old_logprob, advantage, delta
    ), false);
