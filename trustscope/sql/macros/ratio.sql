-- importance ratio r = pi / mu of the sampled token; the log-ratio is clamped at 20 before exp (divergence.ratio).
-- a missing logprob (e.g. old_logprob when pi_old was not recomputed) gives a null ratio.
create or replace macro ratio(pi_logprob, mu_logprob) as
    exp(clamp_max(pi_logprob::double - mu_logprob::double, 20.0));
