-- mergeable per-step aggregates of one tokens file (counts, sums, extremes): step_summary merges them. they are
-- computed once per new file and kept, so the overview costs the same however many tokens a run holds.
-- blocked counts are over the tokens that carry gradient (a != 0): a zero-advantage token has no gradient to block.
with blocks as (
    select * from rule_blocks
),

final as (
    select
        run_id,
        step,
        source_file,
        count(*) as n_tokens,
        count_if(advantage > 0) as n_positive,
        count_if(advantage != 0) as n_nonzero_advantage,
        count_if(advantage < 0) as n_negative,
        count_if(advantage = 0) as n_zero_advantage,
        sum(abs(pi_prob - mu_prob)) as sum_abs_prob_diff,
        max(abs(pi_prob - mu_prob)) as max_abs_prob_diff,
        max(pi_prob - mu_prob) as max_prob_diff,
        min(pi_prob - mu_prob) as min_prob_diff,
        sum(binary_kl) as sum_binary_kl,
        max(binary_kl) as max_binary_kl,
        count(topk_tv) as n_topk,
        sum(topk_tv) as sum_topk_tv,
        max(topk_tv) as max_topk_tv,
        sum(topk_kl) as sum_topk_kl,
        max(topk_kl) as max_topk_kl,
        max(ratio) as max_ratio,
        min(ratio) as min_ratio,
        count(entropy) as n_entropy,
        sum(entropy) as sum_entropy,
        count_if(advantage < 0 and mu_prob - pi_prob >= analysis_param('bad_negative_delta')) as n_bad_negative,
        count_if(not kept and advantage != 0) as n_trainer_blocked,
        count_if(columns('^blocks_(.*)$') and advantage != 0) as 'n_blocked__\1',
        count_if(columns('^blocks_(.*)$') and advantage > 0) as 'n_blocked_pos__\1',
        count_if(columns('^blocks_(.*)$') and advantage < 0) as 'n_blocked_neg__\1'
    from blocks
    group by run_id, step, source_file
)

select * from final
