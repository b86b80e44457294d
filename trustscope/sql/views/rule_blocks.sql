-- the counterfactual: for every registered rule at its default parameters (bound from trustscope.losses), would
-- it block this token? one boolean column blocks_<rule> per rule; pg_is and cispo have no mask and never block.
-- each rule's predicate is its macro (dppo_blocks, ppo_lowprob_relax_blocks, ...); the ppo and minirl masks take
-- the ratios computed once here, and dppo_blocks the divergences token_metrics_core already computed.
-- rule_param() is a constant per query, so each dppo rule computes only the divergence it gates on.
with metrics as (
    select
        run_id, step, rank, sample_id, prompt_id, pos, token_id,
        mu_logprob, old_logprob, pi_logprob, mu_prob, old_prob, pi_prob,
        ratio, ratio(pi_logprob, old_logprob) as old_ratio, binary_tv, binary_kl, topk_tv, topk_kl,
        advantage, entropy, mu_bucket, entropy_bucket, kept, loss_rule, source_file
    from token_metrics_core
),

final as (
    select
        run_id, step, rank, sample_id, prompt_id, pos, token_id,
        mu_prob, pi_prob, ratio, binary_tv, binary_kl, topk_tv, topk_kl,
        advantage, entropy, mu_bucket, entropy_bucket, kept, loss_rule, source_file,
        false as blocks_pg_is,
        false as blocks_cispo,
        ppo_mask_blocks(
            ratio, advantage, rule_param('ppo_clip', 'eps_low'), rule_param('ppo_clip', 'eps_high')
        ) as blocks_ppo_clip,
        ppo_mask_blocks(
            ratio, advantage, rule_param('grpo', 'eps_low'), rule_param('grpo', 'eps_high')
        ) as blocks_grpo,
        coalesce(ppo_mask_blocks(
            old_ratio, advantage, rule_param('minirl', 'eps_low'), rule_param('minirl', 'eps_high')
        ), false) as blocks_minirl,
        coalesce(ppo_mask_blocks(
            old_ratio, advantage, rule_param('minirl_tis', 'eps_low'), rule_param('minirl_tis', 'eps_high')
        ), false) as blocks_minirl_tis,
        dppo_blocks(
            rule_param('dppo_binary_tv', 'divergence'), binary_tv, binary_kl, topk_tv, topk_kl,
            pi_logprob, mu_logprob, advantage, rule_param('dppo_binary_tv', 'delta')
        ) as blocks_dppo_binary_tv,
        dppo_blocks(
            rule_param('dppo_binary_kl', 'divergence'), binary_tv, binary_kl, topk_tv, topk_kl,
            pi_logprob, mu_logprob, advantage, rule_param('dppo_binary_kl', 'delta')
        ) as blocks_dppo_binary_kl,
        dppo_blocks(
            rule_param('dppo_topk_tv', 'divergence'), binary_tv, binary_kl, topk_tv, topk_kl,
            pi_logprob, mu_logprob, advantage, rule_param('dppo_topk_tv', 'delta')
        ) as blocks_dppo_topk_tv,
        dppo_blocks(
            rule_param('dppo_topk_kl', 'divergence'), binary_tv, binary_kl, topk_tv, topk_kl,
            pi_logprob, mu_logprob, advantage, rule_param('dppo_topk_kl', 'delta')
        ) as blocks_dppo_topk_kl,
        coalesce(dppo_mask_blocks(
            divergence_by_name(
                rule_param('dppo_decoupled', 'divergence'),
                abs(pi_prob - old_prob), binary_kl_probs(old_prob, pi_prob, old_logprob, pi_logprob), null, null
            ),
            pi_logprob, old_logprob, advantage, rule_param('dppo_decoupled', 'delta')
        ), false) as blocks_dppo_decoupled,
        ppo_lowprob_relax_blocks(
            pi_logprob, mu_logprob, advantage,
            rule_param('ppo_lowprob_relax', 'eps_low'), rule_param('ppo_lowprob_relax', 'eps_high'),
            rule_param('ppo_lowprob_relax', 'alpha_low'), rule_param('ppo_lowprob_relax', 'alpha_high')
        ) as blocks_ppo_lowprob_relax,
        minimal_negative_mask_blocks(
            pi_logprob, mu_logprob, advantage, rule_param('minimal_negative_mask', 'delta')
        ) as blocks_minimal_negative_mask
    from metrics
)

select * from final
