-- binary kl(mu || pi) from probabilities and logprobs both (views hold both): one log per token.
-- complements 1 - p are clamped at 1e-12, as divergence.binary_kl does.
create or replace macro binary_kl_probs(mu_prob, pi_prob, mu_logprob, pi_logprob) as
    greatest(
        mu_prob * (mu_logprob::double - pi_logprob::double)
        + greatest(1.0 - mu_prob, 1e-12) * ln(greatest(1.0 - mu_prob, 1e-12) / greatest(1.0 - pi_prob, 1e-12)),
        0.0
    );
