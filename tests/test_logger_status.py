"""What the run was and where it stands: run.json's record of the run, token counts, updated_at, stale writers."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from trustscope import runformat as S
from trustscope.logger import LogDirError, TokenLogger, rank_statuses, run_status, run_summary
from trustscope.logger import writer as writer_module

B, T = 8, 5


def step_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), bool)
    mask[0, 2:] = False  # 3 padding tokens
    lp = -rng.random((B, T)).astype(np.float32)
    return {"tokens": {"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": lp, "pi_logprob": lp,
                       "advantage": rng.normal(size=B)},
            "mask": mask, "samples": {"sample_id": np.arange(B), "prompt_id": np.zeros(B, int)}}


def test_run_json_records_the_run_and_counts_tokens_generated_and_logged(tmp_path):
    with TokenLogger(tmp_path, "what", loss_rule="trl:grpo", mu_source="trainer_recompute", token_fraction=0.5,
                     source={"framework": "trl", "version": "1.16.0"}) as lg:
        for step in range(4):
            lg.log_step(step, **step_data(step))
            lg.flush()
            manifest = json.loads((tmp_path / "what" / S.MANIFEST).read_text())
            assert manifest["tokens_generated"] == (step + 1) * (B * T - 3)  # counted as each flush commits
    manifest = json.loads((tmp_path / "what" / S.MANIFEST).read_text())
    assert (manifest["loss_rule"], manifest["mu_source"]) == ("trl:grpo", "trainer_recompute")
    assert manifest["source"] == {"framework": "trl", "version": "1.16.0"}
    assert manifest["logging"]["token_fraction"] == 0.5
    assert manifest["tokens_generated"] == 4 * (B * T - 3)
    assert 0 < manifest["tokens_logged"] < manifest["tokens_generated"]
    assert manifest["tokens_logged"] == manifest["rows"]["tokens"]
    summary = run_summary(tmp_path / "what")
    assert {k: summary[k] for k in ("run_id", "status", "loss_rule", "mu_source", "token_fraction",
                                    "tokens_generated", "tokens_logged", "last_step", "lost")} == {
        "run_id": "what", "status": "finished", "loss_rule": "trl:grpo", "mu_source": "trainer_recompute",
        "token_fraction": 0.5, "tokens_generated": manifest["tokens_generated"],
        "tokens_logged": manifest["tokens_logged"], "last_step": 3, "lost": {}}
    assert summary["updated_at"] == manifest["updated_at"] and summary["ranks"] == {0: "finished"}


def test_token_counts_add_up_over_ranks_and_resumes(tmp_path):
    for rank in (0, 1):
        with TokenLogger(tmp_path, "counts", rank=rank) as lg:
            data = step_data(rank)
            data["samples"]["sample_id"] = np.arange(B) + rank * B
            lg.log_step(0, **data)
    with TokenLogger(tmp_path, "counts", resume=True) as lg:
        lg.log_step(1, **step_data(2))
    summary = run_summary(tmp_path / "counts")
    assert summary["tokens_generated"] == summary["tokens_logged"] == 3 * (B * T - 3)
    assert summary["rows"]["tokens"] == 3 * (B * T - 3) and summary["ranks"] == {0: "finished", 1: "finished"}


def test_updated_at_keeps_moving_while_the_writer_lives(tmp_path):
    lg = TokenLogger(tmp_path, "alive", flush_seconds=0.1)
    lg.log_step(0, **step_data(0))
    lg.flush()
    first = json.loads((tmp_path / "alive" / S.MANIFEST).read_text())["updated_at"]
    for _ in range(100):  # no more data: the idle writer still updates the manifest
        threading.Event().wait(0.05)
        if json.loads((tmp_path / "alive" / S.MANIFEST).read_text())["updated_at"] > first:
            break
    assert json.loads((tmp_path / "alive" / S.MANIFEST).read_text())["updated_at"] > first
    assert run_status(tmp_path / "alive") == "running"
    lg.close()


def test_a_writer_that_stopped_updating_reads_stale(tmp_path):
    with TokenLogger(tmp_path, "quiet", flush_seconds=30) as lg:
        lg.log_step(0, **step_data(0))
    path = tmp_path / "quiet" / S.MANIFEST
    manifest = json.loads(path.read_text())
    long_ago = (datetime.now(UTC) - timedelta(minutes=3)).isoformat()
    path.write_text(json.dumps({**manifest, "status": "running", "pid": os.getpid(), "updated_at": long_ago}))
    assert run_status(tmp_path / "quiet") == "stale"  # the pid lives, but 3 min > 4 x 30 s without an update
    recent = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()
    path.write_text(json.dumps({**manifest, "status": "running", "pid": os.getpid(), "updated_at": recent}))
    assert run_status(tmp_path / "quiet") == "running"
    other_host = {**manifest, "status": "running", "hostname": "elsewhere", "updated_at": long_ago}
    path.write_text(json.dumps(other_host))
    assert rank_statuses(tmp_path / "quiet") == {0: "stale"}


def test_a_run_whose_writer_thread_died_never_reads_running(tmp_path, monkeypatch):
    def crash(self, heartbeat=False):
        raise MemoryError("writer thread ran out of memory")

    monkeypatch.setattr(writer_module.Writer, "_rotate", crash)
    lg = TokenLogger(tmp_path, "died", flush_seconds=3600)
    lg.log_step(0, **step_data(0))
    with pytest.raises(LogDirError):
        lg.flush()
    assert run_status(tmp_path / "died") == "crashed"  # while the process still lives
    assert "writer thread stopped" in run_summary(tmp_path / "died")["error"]
    with pytest.raises(LogDirError):
        lg.close()
    assert run_status(tmp_path / "died") == "crashed"


def test_every_run_summary_key_and_manifest_key_is_documented(tmp_path):
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "logging.md").read_text()
    with TokenLogger(tmp_path, "documented") as lg:
        lg.log_step(0, **step_data(0))
    manifest = json.loads((tmp_path / "documented" / S.MANIFEST).read_text())
    keys = [*run_summary(tmp_path / "documented"), *manifest, *manifest["logging"]]
    missing = sorted({k for k in keys if f"`{k}`" not in docs})
    assert not missing, f"missing from docs/logging.md: {missing}"


def test_drop_steps_after_cuts_whole_flushes_and_recounts_the_manifest(tmp_path):
    from trustscope.logger import drop_steps_after

    with TokenLogger(tmp_path, "cut", token_fraction=0.5) as lg:
        for step in range(5):
            lg.log_step(step, **step_data(step), scalars={"loss": float(step)})
            lg.flush()
    before = json.loads((tmp_path / "cut" / S.MANIFEST).read_text())
    live = TokenLogger(tmp_path, "cut", resume=True)
    with pytest.raises(LogDirError, match="being written by another logger"):
        drop_steps_after(tmp_path / "cut", 2)
    live.close()
    assert drop_steps_after(tmp_path / "cut", 2) == 2 * len(S.TABLES)  # steps 3 and 4: one file per table each
    manifest = json.loads((tmp_path / "cut" / S.MANIFEST).read_text())
    assert manifest["last_step"] == 2 and manifest["rows"]["steps"] == 3
    assert manifest["tokens_generated"] == 3 * (B * T - 3) < before["tokens_generated"]
    assert manifest["tokens_logged"] == manifest["rows"]["tokens"]
    assert S.validate_logdir(tmp_path) == []
    with TokenLogger(tmp_path, "cut", resume=True) as lg:
        lg.log_step(3, **step_data(3))
    assert S.validate_logdir(tmp_path) == []
