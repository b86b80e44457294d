-- binary kl(mu || pi) from probabilities and logprobs both (views hold both): one log per token.
-- complements 1 - p are clamped at 1e-12, as divergence.binary_kl does. null in, null out.
create or replace macro binary_kl_probs(mu_prob, pi_prob, mu_logprob, pi_logprob) as
    clamp_min(
        mu_prob * (mu_logprob::double - pi_logprob::double)
        + clamp_min(1.0 - mu_prob, 1e-12) * ln(clamp_min(1.0 - mu_prob, 1e-12) / clamp_min(1.0 - pi_prob, 1e-12)),
        0.0
    );
