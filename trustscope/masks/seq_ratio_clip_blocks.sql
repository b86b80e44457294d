-- mask family seq_ratio_clip (losses.gspo): ppo's mask on the sequence ratio s = exp(mean log(pi / mu)) of the
-- response (seq_log_ratio, from rule_blocks' window over (run_id, step, rank, sample_id)), the mean log-ratio
-- clamped at 10 before exp; the whole response is blocked together.
create or replace macro seq_ratio_clip_blocks(seq_log_ratio, advantage, eps_low, eps_high) as
    ppo_mask_blocks(exp(clamp_max(seq_log_ratio, 10.0)), advantage, eps_low, eps_high);
