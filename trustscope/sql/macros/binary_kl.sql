-- binary kl(mu || pi) = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)), complements clamped at 1e-12
-- (divergence.binary_kl).
create or replace macro binary_kl(mu_logprob, pi_logprob) as
    binary_kl_probs(exp(mu_logprob::double), exp(pi_logprob::double), mu_logprob, pi_logprob);
