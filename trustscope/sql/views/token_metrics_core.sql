-- per-token metrics without the token text (what the aggregates read): probabilities, ratio, log ratio, binary
-- and top-k tv/kl (top-k from the scalar columns stored at capture time), buckets and advantage sign, and the
-- logger's blocked_rules bits (null for files written without them), the weight version, turn and staleness with
-- the token's position bucket (the summary dimensions), and a run's own columns (every column of tokens but the
-- built-in ones, whose list trustscope.query.catalogue generates from trustscope/columns.py) before source_file.
-- tokens version 4 adds the update of the step, the rollout rejection mask, the rollout IS weight and the last
-- weight version of the trajectory (null in older files), and the routing's first differing layer, replace rate
-- and health bits (mixture-of-experts runs).
with source as (
    select
        run_id, step, rank, sample_id, prompt_id, pos, token_id,
        mu_logprob, old_logprob, pi_logprob, advantage, entropy, topk_tv, topk_kl, kept, loss_rule,
        blocked_rules, policy_version, turn, staleness, engine_token_id, routing_agreement,
        routing_first_layer, routing_replaced, routing_fault,
        update_index, rollout_rejected, is_weight, policy_version_last,
        columns(lambda c: c = 'source_file' or not list_contains([/* built-in token columns */], c))
    from tokens
),

probabilities as (
    select
        *,
        exp(mu_logprob::double) as mu_prob,
        exp(old_logprob::double) as old_prob,
        exp(pi_logprob::double) as pi_prob
    from source
),

final as (
    select
        run_id, step, rank, sample_id, prompt_id, pos, token_id,
        mu_logprob, old_logprob, pi_logprob,
        mu_prob, old_prob, pi_prob,
        pi_prob - mu_prob as prob_diff,
        pi_logprob::double - mu_logprob::double as log_ratio,
        ratio(pi_logprob, mu_logprob) as ratio,
        binary_tv(mu_logprob, pi_logprob) as binary_tv,
        binary_kl_probs(mu_prob, pi_prob, mu_logprob, pi_logprob) as binary_kl,
        topk_tv::double as topk_tv,
        topk_kl::double as topk_kl,
        advantage,
        advantage_sign(advantage) as advantage_sign,
        entropy,
        mu_bucket(mu_prob) as mu_bucket,
        entropy_bucket(entropy) as entropy_bucket,
        kept,
        loss_rule,
        blocked_rules,
        policy_version,
        turn,
        staleness,
        position_bucket(pos) as position_bucket,
        engine_token_id,
        routing_agreement,
        routing_first_layer,
        routing_replaced,
        routing_fault,
        update_index,
        rollout_rejected,
        is_weight,
        policy_version_last,
        columns(lambda c: c = 'source_file' or not list_contains([/* built-in token columns */], c))
    from probabilities
)

select * from final
