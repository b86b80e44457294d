-- importance ratio r = pi / mu of the sampled token; the log-ratio is clamped at 20 before exp (divergence.ratio).
create or replace macro ratio(pi_logprob, mu_logprob) as
    exp(least(pi_logprob::double - mu_logprob::double, 20.0));
