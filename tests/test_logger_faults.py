"""TokenLogger under writer faults: no hang, no good data lost, values refused at the call, one writer per rank."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from trustscope import runformat as S
from trustscope.logger import LogDirError, LogWarning, SchemaError, TokenLogger, run_summary
from trustscope.logger import writer as writer_module

B, T = 3, 4


def step_data(seed: int = 0, **samples):
    rng = np.random.default_rng(seed)
    lp = -rng.random((B, T)).astype(np.float32)
    tokens = {"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": lp, "pi_logprob": lp,
              "advantage": rng.normal(size=B)}
    return {"tokens": tokens, "mask": np.ones((B, T), bool),
            "samples": {"sample_id": np.arange(B), "prompt_id": np.zeros(B, int), **samples}}


def steps_in(run_dir: Path, table: str = "tokens") -> list[int]:
    files = S.committed_files(run_dir)[table]
    if not files:
        return []
    return sorted(set(ds.dataset(files, format="parquet").to_table(columns=["step"])["step"].to_pylist()))


def returns_within(seconds: float, fn, *args):
    """Run ``fn`` in a thread; fail the test if it has not returned after ``seconds``. Returns its exception."""
    out: list[BaseException | None] = []

    def target():
        try:
            fn(*args)
            out.append(None)
        except BaseException as err:
            out.append(err)

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    assert out, f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s"
    return out[0]


def read_only(monkeypatch):
    """Make every write the logger tries fail as on a file system remounted read-only."""
    def fail(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pq, "ParquetWriter", fail)
    monkeypatch.setattr(writer_module.pq, "ParquetWriter", fail)
    monkeypatch.setattr(os, "replace", fail)
    monkeypatch.setattr(Path, "unlink", fail)
    monkeypatch.setattr(Path, "write_text", fail)


def test_log_dir_turning_read_only_never_hangs_and_raises_the_cause(tmp_path, monkeypatch):
    lg = TokenLogger(tmp_path, "ro", row_group_size=4, flush_seconds=3600)
    lg.log_step(0, **step_data(0))
    lg.flush()
    lg.log_step(1, **step_data(1))  # its row groups go to an open temporary file
    for _ in range(100):
        if list((tmp_path / "ro" / "tokens").glob(f"*{S.TMP_SUFFIX}")):
            break
        threading.Event().wait(0.02)
    read_only(monkeypatch)
    lg.log_step(2, **step_data(2))
    err = returns_within(10, lg.flush)
    assert isinstance(err, LogDirError) and "Read-only file system" in str(err)
    assert isinstance(err.__cause__, OSError)
    err = returns_within(10, lg.close)
    assert isinstance(err, LogDirError) and "Read-only file system" in str(err)
    monkeypatch.undo()
    assert steps_in(tmp_path / "ro") == [0]


def test_a_dead_writer_thread_is_reported_at_every_call_and_close_returns(tmp_path, monkeypatch):
    lg = TokenLogger(tmp_path, "dead-writer", flush_seconds=3600)

    def crash(self, heartbeat=False):
        raise MemoryError("writer thread ran out of memory")

    monkeypatch.setattr(writer_module.Writer, "_rotate", crash)
    lg.log_step(0, **step_data(0))
    err = returns_within(10, lg.flush)
    assert isinstance(err, LogDirError) and "writer thread stopped" in str(err) and "out of memory" in str(err)
    with pytest.raises(LogDirError, match="out of memory"):
        lg.log_step(1, **step_data(1))
    err = returns_within(10, lg.close)
    assert isinstance(err, LogDirError)
    manifest = json.loads((tmp_path / "dead-writer" / S.MANIFEST).read_text())
    assert manifest["status"] == "crashed" and manifest["lost"]["rows"]["tokens"] == B * T


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(step=2**63), r"step must be in \[0, 2\*\*63 - 1\].*9223372036854775808"),
    (lambda d: d["samples"].update(prompt_id=np.full(B, 2**63, np.uint64)),
     r"samples\['prompt_id'\]: 9223372036854775808 does not fit"),
    (lambda d: d["tokens"].update(token_id=np.full((B, T), 2**40)), r"tokens\['token_id'\]: 1099511627776 does not"),
    (lambda d: d["samples"].update(response=["ok", "bad \ud800 text", "ok"]),
     r"samples\['response'\] at sample_id 1 is not valid UTF-8"),
    (lambda d: d.update(scalars={"loss\udc80": 1.0}), r"scalar name at row 0 is not valid UTF-8"),
    (lambda d: d.update(scalars={"loss": 10**400}), r"scalars\['loss'\] must be a number"),
])
def test_values_that_would_fail_on_the_writer_are_refused_at_the_call(tmp_path, change, match):
    with TokenLogger(tmp_path, "bad", flush_seconds=3600) as lg:
        lg.log_step(0, **step_data(0))  # a good step, still buffered
        bad = {"step": 1, **step_data(1)}
        change(bad)
        with pytest.raises(SchemaError, match=match):
            lg.log_step(**bad)
        lg.log_step(1, **step_data(2))  # the refused call left no trace
    assert steps_in(tmp_path / "bad") == [0, 1]
    assert S.validate_logdir(tmp_path) == []


def test_a_batch_that_fails_on_the_writer_loses_only_itself(tmp_path, monkeypatch):
    tokens_table = writer_module.Writer._tokens_table

    def broken(self, batch):
        if "mu_topk_ids" in batch.tokens:
            raise RuntimeError("divergence kernel failed")
        return tokens_table(self, batch)

    monkeypatch.setattr(writer_module.Writer, "_tokens_table", broken)
    lg = TokenLogger(tmp_path, "one-bad", flush_seconds=3600, strict=False)  # the failure warns, when it comes
    topk = step_data(1)
    lp = topk["tokens"]["mu_logprob"][..., None]
    topk["tokens"].update(mu_topk_ids=topk["tokens"]["token_id"][..., None], mu_topk_logprobs=lp, pi_topk_logprobs=lp)
    with pytest.warns(LogWarning, match="divergence kernel failed"):
        lg.log_step(0, **step_data(0))
        lg.log_step(1, **topk)  # its Arrow conversion on the writer thread fails
        lg.log_step(2, **step_data(2))  # same flush as steps 0 and 1
        lg.flush()
    lg.close()
    run = tmp_path / "one-bad"
    assert steps_in(run, "tokens") == steps_in(run, "samples") == [0, 2]
    manifest = json.loads((run / S.MANIFEST).read_text())
    assert manifest["status"] == "crashed" and "divergence kernel failed" in manifest["error"]
    lost = manifest["lost"]["rows"]
    assert lost["summaries"] > 0 and {**lost, "summaries": 0} == {"tokens": B * T, "samples": B, "steps": 0,
                                                                   "summaries": 0}
    assert manifest["lost"]["first_step"] == manifest["lost"]["last_step"] == 1
    # the files read clean; validate names the loss, a logging incident of the non-strict logger
    assert [p.message.split(":")[0] for p in S.validate_logdir(tmp_path)] == ["logging incident rows_lost x1 seen by "
                                                                               "rank 0 (steps 1-1)"]


def test_disk_full_is_recorded_and_the_run_does_not_end_finished(tmp_path, monkeypatch):
    lg = TokenLogger(tmp_path, "full", flush_seconds=3600)
    lg.log_step(0, **step_data(0))
    lg.flush()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.pq, "ParquetWriter", full)
    lg.log_step(1, **step_data(1))
    with pytest.raises(LogDirError, match="No space left"):
        lg.flush()  # the trainer catches it and goes on
    monkeypatch.undo()
    lg.log_step(2, **step_data(2))
    lg.close()
    manifest = json.loads((tmp_path / "full" / S.MANIFEST).read_text())
    assert manifest["status"] == "crashed" and "No space left" in manifest["error"]
    assert manifest["lost"]["first_step"] == manifest["lost"]["last_step"] == 1
    assert steps_in(tmp_path / "full") == [0, 2]
    assert run_summary(tmp_path / "full")["lost"] == {0: manifest["lost"]}
    with TokenLogger(tmp_path, "full", resume=True) as lg:  # a later session keeps the record
        lg.log_step(3, **step_data(3))
    resumed = json.loads((tmp_path / "full" / S.MANIFEST).read_text())
    assert resumed["lost"] == manifest["lost"] and resumed["status"] == "finished"
    lost_rows = sum(manifest["lost"]["rows"].values())  # tokens, samples and the step's summary rows
    assert lost_rows > B * T + B
    assert resumed["error"] == f"an earlier session lost {lost_rows} row(s) of steps 1-1 (see lost)"


def test_disk_full_during_close_raises_log_dir_error_and_leaves_no_temporary_manifest(tmp_path, monkeypatch):
    lg = TokenLogger(tmp_path, "full-close", flush_seconds=3600)
    lg.log_step(0, **step_data(0))
    lg.flush()
    real = Path.write_text

    def full(self, data, *args, **kwargs):
        real(self, data[:10], *args, **kwargs)  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(LogDirError, match="No space left on device"):
        lg.close()
    monkeypatch.undo()
    assert not list((tmp_path / "full-close").rglob(f"*{S.TMP_SUFFIX}"))
    assert json.loads((tmp_path / "full-close" / S.MANIFEST).read_text())["status"] == "running"


def test_a_second_logger_on_the_same_rank_is_refused(tmp_path):
    first = TokenLogger(tmp_path, "twice", flush_seconds=3600)
    first.log_step(0, **step_data(0))
    with pytest.raises(LogDirError, match=rf"being written by another logger \(pid {os.getpid()} on host "):
        TokenLogger(tmp_path, "twice", resume=True)
    other_rank = TokenLogger(tmp_path, "twice", rank=1)  # another rank is fine
    other_rank.close()
    first.log_step(1, **step_data(1))
    first.close()
    with TokenLogger(tmp_path, "twice", resume=True) as again:
        again.log_step(2, **step_data(2))
    assert steps_in(tmp_path / "twice") == [0, 1, 2]
    assert S.validate_logdir(tmp_path) == []


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path):
    code = ("import sys, time; from trustscope.logger import TokenLogger; "
            "lg = TokenLogger(sys.argv[1], 'killed'); print('ready', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    lock = tmp_path / "killed" / ".r0000.lock"
    assert json.loads(lock.read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with TokenLogger(tmp_path, "killed", resume=True) as lg:
        lg.log_step(0, **step_data(0))
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert steps_in(tmp_path / "killed") == [0]
    assert not lock.exists()  # a clean close removes it


def test_ranks_with_default_sample_ids_do_not_collide_and_validate_names_collisions(tmp_path):
    for rank in (0, 1):
        data = step_data(rank)
        del data["samples"]["sample_id"]
        with TokenLogger(tmp_path, "defaults", rank=rank) as lg:
            lg.log_step(0, **data)
            lg.log_step(0, **data)  # a second micro-batch of the step counts on
    ids = ds.dataset(S.committed_files(tmp_path / "defaults")["samples"]).to_table()["sample_id"].to_pylist()
    assert sorted(ids) == [*range(2 * B), *range(2**32, 2**32 + 2 * B)]
    assert S.validate_logdir(tmp_path) == []

    for rank in (0, 1):  # both ranks pass arange(B): the keys collide
        with TokenLogger(tmp_path, "clash", rank=rank) as lg:
            lg.log_step(0, **step_data(rank))
    problems = [str(p) for p in S.validate_logdir(tmp_path / "clash")]
    assert any("collide across ranks (e.g. ranks 0 and 1" in p and "samples" in p for p in problems), problems
    assert any("collide across ranks" in p and "tokens" in p for p in problems), problems


def test_micro_batches_with_scalars(tmp_path):
    with TokenLogger(tmp_path, "micro-scalars") as lg:
        first = step_data(0)
        lg.log_step(0, **first, scalars={"loss": 1.0})
        second = step_data(1)
        second["samples"]["sample_id"] = np.arange(B) + B
        with pytest.raises(SchemaError, match=r"scalars\['loss'\] was already logged at step 0 by rank 0"):
            lg.log_step(0, **second, scalars={"loss": 2.0})
        lg.log_step(0, **second, scalars={"grad_norm": 3.0})  # other names merge into the step
        lg.log_step(1, **first, scalars={"loss": 4.0})
    assert S.validate_logdir(tmp_path) == []
    steps = ds.dataset(S.committed_files(tmp_path / "micro-scalars")["steps"]).to_table().sort_by("value")
    assert list(zip(steps["step"].to_pylist(), steps["name"].to_pylist(), strict=True)) == [
        (0, "loss"), (0, "grad_norm"), (1, "loss")]


def test_a_file_system_without_locks_logs_unlocked_with_a_warning(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(LogWarning, match="cannot be locked on this file system"), \
            TokenLogger(tmp_path, "nolock") as lg:
        lg.log_step(0, **step_data(0))
    assert steps_in(tmp_path / "nolock") == [0]
