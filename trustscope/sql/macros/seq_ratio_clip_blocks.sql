-- mask family seq_ratio_clip (losses.gspo): ppo's mask on the sequence ratio s = exp(mean log(pi / mu)) over the
-- response's window (run_id, step, rank, sample_id), the mean log-ratio clamped at 10 before exp; the whole
-- response is blocked together.
create or replace macro seq_ratio_clip_blocks(run_id, step, rank, sample_id, pos, log_ratio, advantage,
                                              eps_low, eps_high) as
    ppo_mask_blocks(
        exp(clamp_max(avg(log_ratio) over (partition by run_id, step, rank, sample_id), 10.0)),
        advantage, eps_low, eps_high
    );
