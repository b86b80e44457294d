"""The early-warning signals: exact over every token at log time, mergeable over calls, flushes and ranks, and
read back by the ``early_signals`` view as a float64 reference computes them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from trustscope import db as tsdb
from trustscope.logger import TokenLogger
from trustscope.logger.summaries import HIST_EDGES

B, T, STEPS = 24, 20, 5


def step_data(step: int) -> tuple[dict, np.ndarray, dict]:
    """A padded step: responses of 4-20 tokens, most with pi near mu, a few far (heavy-tailed weights)."""
    rng = np.random.default_rng(100 + step)
    lengths = rng.integers(4, T + 1, B)
    mask = np.arange(T)[None, :] < lengths[:, None]  # (B, T)
    mu = np.log(rng.uniform(1e-3, 1.0, (B, T))).astype(np.float32)
    far = rng.random((B, 1)) < 0.2
    shift = np.where(far, rng.normal(0, 0.8, (B, T)), rng.normal(0, 0.02, (B, T)))
    pi = np.minimum(mu + shift.astype(np.float32), 0).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    tokens = {"token_id": rng.integers(0, 50, (B, T)), "mu_logprob": mu, "pi_logprob": pi, "advantage": adv,
              "entropy": (rng.exponential(1.0, (B, T)) / (1 + step)).astype(np.float32),
              "kept": rng.random((B, T)) > 0.1}
    samples = {"sample_id": np.arange(B), "prompt_id": np.arange(B) // 4, "reward": rng.random(B)}
    return tokens, mask, samples


GRAD = [0.5, 0.7, 1.5, 3.0, 0.9]


def log(logdir, run_id: str, *, ranks: int, calls: int, fraction: float, flush_rows: int) -> None:
    for rank in range(ranks):
        with TokenLogger(logdir, run_id, rank=rank, token_fraction=fraction, flush_rows=flush_rows,
                         loss_rule="dppo_binary_tv") as lg:
            for step in range(STEPS):
                tokens, mask, samples = step_data(step)
                mine = np.arange(B)[rank::ranks]  # this rank's responses
                for k, part in enumerate(np.array_split(mine, calls)):
                    scalars = {"grad_norm": GRAD[step]} if rank == 0 and k == 0 else None
                    lg.log_step(step, tokens={n: v[part] for n, v in tokens.items()}, mask=mask[part],
                                samples={n: v[part] for n, v in samples.items()}, scalars=scalars)


@pytest.fixture(scope="module")
def signals(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("early")
    log(logdir, "one-shot", ranks=1, calls=1, fraction=1.0, flush_rows=1_000_000)
    log(logdir, "micro-batches", ranks=1, calls=3, fraction=0.25, flush_rows=1)
    log(logdir, "two-ranks", ranks=2, calls=2, fraction=0.5, flush_rows=50)
    with tsdb.connect(logdir) as conn:
        yield conn.sql("select * from early_signals order by run_id, step").to_pandas()


def tail(values: np.ndarray, q: float) -> float:
    """bin_high of the histogram bin holding the q-quantile: the smallest value with a share >= q at or below."""
    v = np.sort(values)[math.ceil(q * len(values)) - 1]
    return float(HIST_EDGES[np.searchsorted(HIST_EDGES, v, side="right")])


def reference() -> pd.DataFrame:
    """Every signal from the step's arrays in float64, over every token, with no logger involved."""
    rows = []
    for step in range(STEPS):
        tokens, mask, _ = step_data(step)
        lr = tokens["pi_logprob"].astype(np.float64) - tokens["mu_logprob"].astype(np.float64)  # (B, T)
        w = np.exp(lr[mask])
        seq = np.array([lr[b][mask[b]].mean() for b in range(B)])  # (B,)
        sw = np.exp(seq)
        rows.append({"step": step, "n_tokens": int(mask.sum()), "n_responses": B,
                     "ess_frac": w.sum() ** 2 / (w ** 2).sum() / len(w),
                     "seq_ess_frac": sw.sum() ** 2 / (sw ** 2).sum() / B, "is_weight_max": w.max(),
                     "log_ratio_min": lr[mask].min(), "log_ratio_max": lr[mask].max(),
                     "log_ratio_std": lr[mask].std(), "seq_log_ratio_max": np.abs(seq).max(),
                     **{f"seq_log_ratio_p{int(q * 100)}": tail(np.abs(seq), q) for q in (0.5, 0.9, 0.99)},
                     "entropy_mean": tokens["entropy"].astype(np.float64)[mask].mean(), "grad_norm": GRAD[step]})
    return pd.DataFrame(rows)


COLUMNS = ["n_tokens", "n_responses", "ess_frac", "seq_ess_frac", "is_weight_max", "log_ratio_min", "log_ratio_max",
           "log_ratio_std", "seq_log_ratio_max", "seq_log_ratio_p50", "seq_log_ratio_p90", "seq_log_ratio_p99",
           "entropy_mean", "grad_norm"]


@pytest.mark.parametrize("run_id", ["one-shot", "micro-batches", "two-ranks"])
def test_signals_equal_a_float64_reference_over_every_token(signals, run_id):
    ours = signals[signals.run_id == run_id].reset_index(drop=True)
    ref = reference()
    assert len(ours) == STEPS and ours.ess_frac.between(0.05, 0.999).all()  # the far responses weigh
    for column in COLUMNS:
        np.testing.assert_allclose(ours[column].to_numpy(float), ref[column].to_numpy(float), rtol=1e-6,
                                   err_msg=f"{run_id}: {column}")


def test_calls_flushes_and_ranks_merge_to_the_one_shot_figures(signals):
    one = signals[signals.run_id == "one-shot"].drop(columns="run_id").reset_index(drop=True)
    for run_id in ("micro-batches", "two-ranks"):
        other = signals[signals.run_id == run_id].drop(columns="run_id").reset_index(drop=True)
        # sums added in another order: equal to the last bits of a float64
        pd.testing.assert_frame_equal(one, other, check_exact=False, rtol=1e-12, obj=run_id)


def test_slopes_are_the_least_squares_fit_of_the_last_ten_steps(signals):
    ours = signals[signals.run_id == "one-shot"].set_index("step")
    assert ours.entropy_slope.iloc[:2].isna().all()  # fewer than 3 steps: no slope
    for step in range(2, STEPS):
        window = ours.loc[max(0, step - 9):step]
        expected = np.polyfit(window.index.to_numpy(float), window.entropy_mean.to_numpy(), 1)[0]
        assert ours.entropy_slope[step] == pytest.approx(expected, rel=1e-9)
        expected = np.polyfit(window.index.to_numpy(float), window.mismatch_mean.to_numpy(), 1)[0]
        assert ours.mismatch_slope[step] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert (ours.entropy_slope.iloc[2:] < 0).all()  # the generator's entropy falls with the step
