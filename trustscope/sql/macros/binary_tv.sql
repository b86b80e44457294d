-- binary tv: the vocabulary collapsed to {sampled token, rest}, which is |pi - mu| (divergence.binary_tv).
create or replace macro binary_tv(mu_logprob, pi_logprob) as
    abs(exp(pi_logprob::double) - exp(mu_logprob::double));
