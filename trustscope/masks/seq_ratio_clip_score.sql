-- the scale at which mask family seq_ratio_clip starts to block a response (masks.seq_ratio_clip.score_seq_ratio_clip): ppo's
-- clip score on the sequence ratio s = exp(mean log(pi / mu)), the mean clamped at 10 first.
create or replace macro seq_ratio_clip_score(seq_log_ratio, advantage, eps_low, eps_high) as
    ratio_clip_score(exp(clamp_max(seq_log_ratio, 10.0)), advantage, eps_low, eps_high, null);
