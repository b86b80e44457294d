"""TokenLogger's memory bound (``max_buffered_rows``) and its policy (``on_full``) against a store slower than the
trainer: the store's ``publish`` (the fsync and rename of each flush file) is throttled with a sleep."""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pyarrow.dataset as ds
import pytest

from trustscope.logger import LogWarning, TokenLogger
from trustscope.runformat.stores import LocalStore

B, T = 4, 25  # 100 token rows a call


def step_data(step: int, b: int = B, t: int = T, first_id: int = 0) -> dict:
    rng = np.random.default_rng(step)
    mu = -rng.random((b, t)).astype(np.float32) * 4  # (B, T)
    return {"tokens": {"token_id": rng.integers(0, 50, (b, t)), "mu_logprob": mu, "pi_logprob": mu - 0.01,
                       "advantage": rng.normal(size=b).astype(np.float32)},
            "samples": {"sample_id": np.arange(b) + first_id, "prompt_id": np.arange(b) // 2,
                        "reward": rng.random(b)},
            "scalars": {f"loss/{first_id}": float(step)}}


@pytest.fixture
def slow_store(monkeypatch):
    """Every flush file takes ``delay[0]`` seconds to store."""
    delay = [0.05]
    publish = LocalStore.publish

    def slow(self, tmp, final, fsync):
        time.sleep(delay[0])
        publish(self, tmp, final, fsync)

    monkeypatch.setattr(LocalStore, "publish", slow)
    return delay


def table(run_dir, name):
    return ds.dataset(run_dir / name, format="parquet").to_table()


def open_logger(tmp_path, run_id, **kw):
    return TokenLogger(tmp_path, run_id, flush_rows=50, write_threads=1, summaries=False, compact_every=0,
                       fsync=False, **kw)


def assert_steps_whole(run_dir, steps: int):
    """Every committed sequence has all its token rows (its length), no token row lacks its sample, and every
    step's scalars are there."""
    tokens, samples = table(run_dir, "tokens").to_pandas(), table(run_dir, "samples").to_pandas()
    per_seq = tokens.groupby(["step", "sample_id"]).size()
    lengths = samples.set_index(["step", "sample_id"])["length"]
    assert per_seq.to_dict() == lengths[lengths > 0].to_dict()
    assert sorted(table(run_dir, "steps").to_pandas()["step"].unique()) == list(range(steps))
    return tokens, samples


def test_block_waits_and_nothing_is_dropped(tmp_path, slow_store):
    steps = 12
    with open_logger(tmp_path, "block", max_buffered_rows=200, on_full="block", block_timeout_s=None) as lg:
        t0 = time.perf_counter()
        for s in range(steps):
            lg.log_step(s, **step_data(s))
            assert lg.buffer["rows"] <= 200
        waited = time.perf_counter() - t0
        buffer = lg.buffer
    manifest = json.loads((tmp_path / "block" / "run.json").read_text())
    assert buffer["blocked_calls"] > 0 and waited > 0.5  # the trainer was slowed to the store's pace
    assert manifest["buffer"]["dropped_rows"] == 0 and manifest["dropped_rows"] == 0
    assert manifest["buffer"]["peak_rows"] <= 200
    assert manifest["logging"]["max_buffered_rows"] == 200 and manifest["logging"]["on_full"] == "block"
    tokens, _ = assert_steps_whole(tmp_path / "block", steps)
    assert len(tokens) == steps * B * T == manifest["rows"]["tokens"]


def test_drop_keeps_memory_bounded_and_counts_what_was_not_written(tmp_path, slow_store):
    slow_store[0] = 0.1
    steps, bound = 20, 150
    with (pytest.warns(LogWarning, match=r"dropped \d+ of 4 sequence\(s\).*max_buffered_rows=150"),
          open_logger(tmp_path, "drop", max_buffered_rows=bound, on_full="drop") as lg):
        t0 = time.perf_counter()
        for s in range(steps):
            lg.log_step(s, **step_data(s))
            assert lg.buffer["rows"] <= bound
        logging_s = time.perf_counter() - t0
    manifest = json.loads((tmp_path / "drop" / "run.json").read_text())
    buffer = manifest["buffer"]
    tokens, samples = assert_steps_whole(tmp_path / "drop", steps)
    assert buffer["peak_rows"] <= bound
    assert buffer["dropped_rows"] > 0 and buffer["blocked_calls"] == 0
    assert buffer["dropped_rows"] == steps * B * T - len(tokens)  # what was not written, exactly
    assert buffer["dropped_sequences"] == steps * B - len(samples)
    assert manifest["dropped_rows"] == buffer["dropped_rows"]  # no bad rows here: all of them are the bound's
    assert manifest["tokens_generated"] == steps * B * T
    for _, ids in samples.groupby("step")["sample_id"]:  # the trailing sequences go, the leading ones stay
        assert sorted(ids) == list(range(len(ids)))
    assert logging_s < 0.5 * steps * 0.1  # log_step did not wait for the store


def test_block_falls_through_to_drop_after_the_timeout(tmp_path, slow_store):
    slow_store[0] = 0.5
    with (pytest.warns(LogWarning, match="waited block_timeout_s=0.05 s"),
          open_logger(tmp_path, "timeout", max_buffered_rows=100, on_full="block", block_timeout_s=0.05) as lg):
        for s in range(4):
            lg.log_step(s, **step_data(s))
    buffer = json.loads((tmp_path / "timeout" / "run.json").read_text())["buffer"]
    tokens, _ = assert_steps_whole(tmp_path / "timeout", 4)
    assert buffer["blocked_calls"] > 0 and buffer["dropped_rows"] == 4 * B * T - len(tokens) > 0


def test_a_step_larger_than_the_bound_is_stored_in_parts(tmp_path, slow_store):
    """Micro-batches of one step that together exceed the bound: the open flush is stored in the middle of the
    step (automatic flushes wait for the next step), so ``block`` does not wait for ``flush_seconds``."""
    with open_logger(tmp_path, "big", max_buffered_rows=250, on_full="block", block_timeout_s=20,
                     flush_seconds=60) as lg:
        t0 = time.perf_counter()
        for part in range(6):
            lg.log_step(0, **step_data(part, first_id=100 * part))
        assert time.perf_counter() - t0 < 10
    manifest = json.loads((tmp_path / "big" / "run.json").read_text())
    assert manifest["buffer"]["dropped_rows"] == 0 and manifest["rows"]["tokens"] == 6 * B * T
    assert manifest["committed_flush"] >= 2


def test_a_call_larger_than_the_bound_keeps_the_sequences_that_fit(tmp_path):
    with (pytest.warns(LogWarning, match=r"dropped 2 of 4 sequence\(s\) \(50 token rows\).*alone exceed"),
          open_logger(tmp_path, "huge", max_buffered_rows=60, on_full="block", block_timeout_s=5) as lg):
        lg.log_step(0, **step_data(0))
    manifest = json.loads((tmp_path / "huge" / "run.json").read_text())
    tokens, samples = assert_steps_whole(tmp_path / "huge", 1)
    assert len(tokens) == 50 and sorted(samples["sample_id"]) == [0, 1]
    assert manifest["buffer"]["dropped_rows"] == 50 and manifest["buffer"]["dropped_sequences"] == 2


def test_defaults_never_bound_a_normal_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogWarning)
        with open_logger(tmp_path, "default") as lg:
            for s in range(5):
                lg.log_step(s, **step_data(s))
    manifest = json.loads((tmp_path / "default" / "run.json").read_text())
    assert manifest["logging"]["max_buffered_rows"] == 4_000_000
    assert manifest["logging"]["on_full"] == "block" and manifest["logging"]["block_timeout_s"] == 60.0
    assert manifest["buffer"]["dropped_rows"] == 0 and manifest["buffer"]["blocked_calls"] == 0
    with TokenLogger(tmp_path, "big-flushes", flush_rows=2_000_000) as lg:
        assert lg.manifest["logging"]["max_buffered_rows"] == 8_000_000


@pytest.mark.parametrize("option, value", [
    ("max_buffered_rows", 0), ("max_buffered_rows", -5), ("max_buffered_rows", 1.5), ("max_buffered_rows", True),
    ("max_buffered_rows", "100"), ("on_full", "spill"), ("on_full", None), ("block_timeout_s", -1),
    ("block_timeout_s", float("inf")), ("block_timeout_s", float("nan")), ("block_timeout_s", "10"),
])
def test_bad_values_are_refused(tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"^{option} must .*got {value!r}"):
        TokenLogger(tmp_path, "bad", **{option: value})
    assert not (tmp_path / "bad").exists()


def test_the_counts_add_up_over_a_resumed_run(tmp_path, slow_store):
    for session in range(2):
        with (pytest.warns(LogWarning, match="dropped"),
              open_logger(tmp_path, "resumed", max_buffered_rows=100, on_full="drop", resume=session > 0) as lg):
            for s in range(4 * session, 4 * session + 4):
                lg.log_step(s, **step_data(s))
    manifest = json.loads((tmp_path / "resumed" / "run.json").read_text())
    tokens, _ = assert_steps_whole(tmp_path / "resumed", 8)
    assert manifest["buffer"]["dropped_rows"] == 8 * B * T - len(tokens)
    assert manifest["buffer"]["last_dropped_step"] >= 4
