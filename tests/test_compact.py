"""Compaction (trustscope/runformat/compaction.py, `trustscope compact`, `TokenLogger(compact_every=...)`): the same rows
in fewer files, switched over in one manifest write; killed at random, on a full disk, a read-only directory, on S3."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trustscope import runformat as C
from trustscope import runformat as S
from trustscope.cli import app
from trustscope.logger import TokenLogger, drop_steps_after
from trustscope.runformat import swap

B, T, K = 4, 8, 3
STEPS = 24
RUN = "c"


def log_steps(logdir: Path, first: int, last: int, *, resume: bool = False, **options) -> None:
    """Steps ``first..last`` logged with a flush after every step, top-K on, two encoder parts, row groups of 8."""
    options = {"compact_every": 0, "flush_rows": 1, "fsync": False, "write_threads": 2, "row_group_size": 8,
               **options}
    with TokenLogger(logdir, RUN, resume=resume, vocab=[str(i) for i in range(50)], **options) as lg:
        for step in range(first, last + 1):
            rng = np.random.default_rng(step)
            topk = -np.sort(rng.random((B, T, K), dtype=np.float32) * 4, axis=-1)
            lg.log_step(step, tokens={"token_id": rng.integers(0, 50, (B, T)), "mu_logprob": topk[..., 0],
                                      "pi_logprob": topk[..., 0] - 0.01, "advantage": rng.normal(size=B),
                                      "mu_topk_ids": rng.integers(0, 50, (B, T, K)), "mu_topk_logprobs": topk,
                                      "pi_topk_logprobs": topk},
                        mask=np.ones((B, T), dtype=bool),
                        samples={"sample_id": np.arange(B), "prompt_id": np.arange(B) // 2, "reward": rng.random(B)},
                        scalars={"loss": float(step)})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A log of STEPS per-step flushes, never compacted; tests work on copies (:func:`copy_of`)."""
    logdir = tmp_path_factory.mktemp("pristine")
    log_steps(logdir, 0, STEPS - 1)
    return logdir


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A log of KILL_STEPS per-step flushes, for the kills (each kill compacts a fresh copy)."""
    logdir = tmp_path_factory.mktemp("small")
    log_steps(logdir, 0, KILL_STEPS - 1)
    return logdir


def copy_of(pristine: Path, where: Path) -> Path:
    shutil.copytree(pristine, where)
    return where / RUN


def rows(run_dir: Path) -> dict[str, pa.Table]:
    """Every table as a reader sees it, rows in file order (committed files, sorted by name)."""
    files = S.committed_files(run_dir)
    return {t: ds.dataset(files[t], format="parquet").to_table() if files[t] else None for t in S.TABLES}


def in_key_order(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    return {t: data.sort_by([(c, "ascending") for c in S.KEYS[t] if c != "run_id"]) for t, data in tables.items()}


def n_files(run_dir: Path) -> int:
    return sum(len(files) for files in S.committed_files(run_dir).values())


def count(db, query: str) -> int:
    return db.sql(query).table["n"][0].as_py()


def compact(target: Path | str, *args: str) -> str:
    result = CliRunner().invoke(app, ["compact", str(target), "--grace", "0", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_compacted_log_reads_the_same_rows_in_order_with_the_loggers_encodings(pristine, tmp_path):
    run = copy_of(pristine, tmp_path / "log")
    before, files_before = rows(run), n_files(run)
    footers = {t: pq.read_metadata(S.committed_files(run)[t][0]).metadata for t in S.TABLES}
    compact(tmp_path / "log")
    assert files_before == STEPS * 5 and n_files(run) == 4  # tokens in two parts a flush
    after = rows(run)
    for table in S.TABLES:  # a flush's parts are interleaved again by row group: the rows come back as logged
        assert after[table].equals(in_key_order(before)[table] if table == "tokens" else before[table]), table
    assert after["tokens"].equals(in_key_order(after)["tokens"])
    assert sorted(p.name for p in (run / "tokens" / "r0000").iterdir()) == [
        S.compacted_file_name(0, 0, STEPS - 1, (1, STEPS))]
    manifest = S.read_manifest(run)
    assert [r["flushes"] for r in manifest[S.COMPACTED_KEY]] == [[1, STEPS]]
    for table in S.TABLES:
        [path] = S.committed_files(run)[table]
        meta = pq.read_metadata(path)
        kv = meta.metadata
        for key, value in footers[table].items():  # what the sources agree on is kept, the flush's own is not
            if key.startswith(S.FLUSH_META_PREFIX.encode()):
                assert key not in kv
            elif key != b"ARROW:schema":
                assert kv[key] == value, key
        sources = json.loads(kv[C.SOURCES_META.encode()])
        originals = json.loads(kv[C.ORIGINALS_META.encode()])
        assert sum(n for _, n in sources) == meta.num_rows == sum(o[4] for o in originals)
        assert [o[1] for o in originals] == sorted(o[1] for o in originals)
        assert len(sources) == (2 * STEPS if table == "tokens" else STEPS)
        column = meta.row_group(0).column(meta.schema.to_arrow_schema().names.index(
            "mu_logprob" if table == "tokens" else "step"))
        assert column.compression == "ZSTD"
        if table == "tokens":
            assert "BYTE_STREAM_SPLIT" in column.encodings
    assert S.validate_run(run) == []
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "log")])
    assert result.exit_code == 0, result.output
    compact(tmp_path / "log")  # nothing left to merge: a no-op
    assert n_files(run) == 4 and [r["flushes"] for r in S.read_manifest(run)[S.COMPACTED_KEY]] == [[1, STEPS]]


def test_the_query_layer_answers_the_same(pristine, tmp_path, monkeypatch):
    from trustscope.db import connect

    plain = copy_of(pristine, tmp_path / "plain")
    packed = copy_of(pristine, tmp_path / "packed")
    compact(packed)
    answers = []
    for logdir in (plain.parent, packed.parent):
        monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / f"cache-{logdir.name}"))
        with connect(logdir) as db:
            answers.append((db.step_summary(), count(db, "select count(*) n from tokens"),
                            count(db, "select count(distinct step) n from samples")))
    pd.testing.assert_frame_equal(answers[0][0], answers[1][0], rtol=1e-9)  # sums in another order
    assert answers[0][1:] == answers[1][1:] == (STEPS * B * T, STEPS)


def test_files_whose_footers_disagree_are_not_merged(pristine, tmp_path):
    """The rule list in the tokens footers (``blocked_rules``) changes at a resume without summaries: the two
    sides are compacted apart, and each compacted file keeps its own side's footer."""
    run = copy_of(pristine, tmp_path / "log")
    log_steps(tmp_path / "log", STEPS, STEPS + 5, resume=True, summaries=False)
    compact(tmp_path / "log")
    records = S.read_manifest(run)[S.COMPACTED_KEY]
    assert [r["flushes"] for r in records] == [[1, STEPS], [STEPS + 1, STEPS + 6]]
    first, second = (pq.read_metadata(run / r["files"][0]).metadata for r in records)
    assert S.BLOCKED_RULES_META.encode() in first and S.BLOCKED_RULES_META.encode() not in second
    assert S.validate_run(run) == []
    assert in_key_order(rows(run))["tokens"].num_rows == (STEPS + 6) * B * T


def test_the_loggers_background_compaction_and_a_reader_polling_meanwhile(tmp_path):
    """compact_every=4: the writer goes on; a reader listing and reading all the while sees every committed step
    once, in every table, never one twice or torn; resume of the compacted run works."""
    run = tmp_path / RUN
    seen, errors, retried, stop = [], [], [], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                files = S.committed_files(run)
                manifest = S.read_manifest(run) if (run / S.MANIFEST).exists() else None
                if manifest is None or not files["steps"]:
                    continue
                tables = {t: ds.dataset(files[t], format="parquet").to_table(columns=["step"]) for t in S.TABLES}
            except FileNotFoundError:  # a file listed, then compacted away by a swap of its folder: read again
                retried.append(1)
                continue
            except S.SchemaError as err:  # before the run exists
                if run.exists() and (run / S.MANIFEST).exists():
                    errors.append(err)
                continue
            counts = {t: np.bincount(d["step"].to_numpy()) for t, d in tables.items()}
            seen.append({t: c.tolist() for t, c in counts.items()})

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        log_steps(tmp_path, 0, 39, compact_every=4)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:3]
    assert len(seen) > 5
    for view in seen:
        steps = view["tokens"]
        n = len(steps)
        assert steps == [B * T] * n, "a step doubled, torn or missing in tokens"
        assert view["samples"] == [B] * n and view["steps"] == [1] * n
        assert len(view["summaries"]) == n and min(view["summaries"]) > 0
    manifest = S.read_manifest(run)
    assert manifest["logging"]["compact_every"] == 4
    assert n_files(run) < 40 and manifest[S.COMPACTED_KEY]
    assert S.validate_run(run) == []
    log_steps(tmp_path, 40, 44, resume=True, compact_every=4)
    assert S.validate_run(run) == []
    assert rows(run)["tokens"].num_rows == 45 * B * T


def test_a_reader_polling_during_trustscope_compact_sees_every_step_once(pristine, tmp_path):
    """Three compactions of a copy (one merge each time: the log is grown between them), a reader listing and
    reading all the while: every view holds each step once, in every table; a listing taken just before a swap
    of the rank folder may find a file gone (the reader reads again), never a wrong count."""
    run = copy_of(pristine, tmp_path / "log")
    views, errors, stop = [], [], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                files = S.committed_files(run)
                tables = {t: ds.dataset(files[t], format="parquet").to_table(columns=["step"]) for t in S.TABLES}
            except FileNotFoundError:  # a listed file compacted away by a swap before it was read: again
                continue
            except Exception as err:
                errors.append(err)
                continue
            views.append({t: np.bincount(d["step"].to_numpy()).tolist() for t, d in tables.items()})

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(3):
            if i:
                log_steps(tmp_path / "log", STEPS + 2 * i - 2, STEPS + 2 * i - 1, resume=True)
            C.compact_logdir(tmp_path / "log", grace_s=0.5)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:3]
    assert len(views) > 3
    for view in views:
        n = len(view["tokens"])
        assert view["tokens"] == [B * T] * n and view["samples"] == [B] * n and view["steps"] == [1] * n
    assert n_files(run) == 4


def test_drop_steps_after_cuts_a_compacted_file(pristine, tmp_path):
    run = copy_of(pristine, tmp_path / "log")
    log_steps(tmp_path / "log", STEPS, STEPS + 3, resume=True)
    compact(tmp_path / "log")
    expected = in_key_order(rows(run))
    drop_steps_after(run, 10)
    manifest = S.read_manifest(run)
    assert [r["flushes"] for r in manifest[S.COMPACTED_KEY]] == [[1, 11]]
    assert manifest["last_step"] == 10 and manifest["rows"]["tokens"] == 11 * B * T
    assert manifest["tokens_logged"] == 11 * B * T
    cut = in_key_order(rows(run))
    for table, data in cut.items():
        assert data.equals(expected[table].filter(pa.compute.less_equal(expected[table]["step"], 10)))
    assert S.validate_run(run) == []
    log_steps(tmp_path / "log", 11, 12, resume=True)
    assert S.validate_run(run) == []


def test_committed_files_reads_the_manifests_only(pristine, tmp_path, monkeypatch):
    run = copy_of(pristine, tmp_path / "log")
    compact(tmp_path / "log")
    opened = []
    real_open = open

    def recording_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", recording_open)
    files = S.committed_files(run)
    assert sum(map(len, files.values())) == 4
    assert opened and all(p.endswith(".json") for p in opened)


# ------------------------------------------------------------------------------------------------ faults

KILLS = 50
KILL_STEPS = 10


def _kill_point_child(logdir: Path, mode: str, value: float) -> None:
    """In a forked child: compact ``logdir``, SIGKILLing itself after ``value`` seconds (mode "time") or at the
    ``value``-th rename or delete (mode "op"). Never returns."""
    try:
        if mode == "op":
            count = [0]
            real_replace, real_unlink = os.replace, Path.unlink

            def die_at(real):
                def wrapped(*args, **kwargs):
                    count[0] += 1
                    if count[0] == value:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return wrapped

            os.replace = die_at(real_replace)
            Path.unlink = die_at(real_unlink)
        else:
            threading.Timer(value, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        C.compact_logdir(logdir, grace_s=0)
        os.kill(os.getpid(), signal.SIGKILL)  # killed "after the end" counts as a kill too
    finally:
        os._exit(3)


def _fork_and_kill(logdir: Path, mode: str, value: float) -> None:
    pid = os.fork()
    if pid == 0:
        _kill_point_child(logdir, mode, value)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _timed_compaction(pristine: Path, where: Path) -> tuple[float, int]:
    """Seconds and file operations (renames and deletes) one whole compaction of a copy of ``pristine`` takes."""
    copy_of(pristine, where)
    ops = [0]
    real_replace, real_unlink = os.replace, Path.unlink

    def count(real):
        def wrapped(*args, **kwargs):
            ops[0] += 1
            return real(*args, **kwargs)
        return wrapped

    os.replace, Path.unlink = count(real_replace), count(real_unlink)
    try:
        started = time.perf_counter()
        C.compact_logdir(where, grace_s=0)
        return time.perf_counter() - started, ops[0]
    finally:
        os.replace, Path.unlink = real_replace, real_unlink


@pytest.mark.heavy  # a minute and more on 2 cores: .ci/run's heavy step
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_at_random_moments_of_a_compaction(small, tmp_path, monkeypatch):
    """50 kills, half at a random moment, half at a random rename or delete: nothing lost, nothing doubled,
    validate passes, and a later compaction (or the logger's resume) finishes the job."""
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    expected = in_key_order(rows(small / RUN))
    seconds, ops = _timed_compaction(small, tmp_path / "timed")
    rng = random.Random(21)
    for kill in range(KILLS):
        logdir = tmp_path / f"k{kill}"
        run = copy_of(small, logdir)
        mode, value = ("op", rng.randint(1, ops)) if kill % 2 else ("time", rng.uniform(0, 1.2 * seconds))
        _fork_and_kill(logdir, mode, value)
        got = in_key_order(rows(run))
        for table in S.TABLES:
            assert got[table].equals(expected[table]), f"kill {kill}: {table} differs"
            glob = str(run / table / "**" / "*.parquet")  # a plain reader of the folders, no manifest
            assert duckdb.sql(f"select count(*) from read_parquet('{glob}')").fetchall()[0][0] == \
                expected[table].num_rows, f"kill {kill}: {table} read by a glob"
        assert S.validate_run(run) == [], kill
        if kill in (0, KILLS - 1):
            result = CliRunner().invoke(app, ["sql", str(logdir), "select count(*) n from tokens", "-f", "csv"])
            assert result.exit_code == 0 and result.output.split()[-1] == str(KILL_STEPS * B * T), result.output
        if kill % 10 == 9:
            log_steps(logdir, KILL_STEPS, KILL_STEPS, resume=True)  # the logger reopens a half-compacted run
            assert S.validate_run(run) == []
            assert rows(run)["tokens"].num_rows == (KILL_STEPS + 1) * B * T
        said = compact(logdir)
        for table in S.TABLES:
            data = in_key_order(rows(run))[table]
            assert data.slice(0, expected[table].num_rows).equals(expected[table]), f"kill {kill}: {table}"
        left = sorted(p.relative_to(run).as_posix() for p in run.rglob("*")
                      if p.is_file() and p.relative_to(run).parts[0] in S.TABLES)
        assert left and all(S.parse_data_file(n.rpartition("/")[2]).compacted for n in left), \
            (f"kill {kill} ({mode} {value}): sources or leftovers kept", left, said)
        assert not (run / S.STAGING_DIR).exists() and not (run / S.SUPERSEDED_DIR).exists(), (kill, mode, value, said)
        shutil.rmtree(logdir)


def _killed_after_the_first_swap(logdir: Path, holder: tuple[int, int] | None = None) -> None:
    """Compact ``logdir`` in a forked child SIGKILLed right after it swapped the first table's rank folder (tokens)
    and before the others. ``holder``: a pipe; the child first forks a process that keeps a copy of every
    descriptor, the rank's lock among them, until the pipe's write end closes (at most 60 s): what a child
    process between its fork and its exec does."""
    pid = os.fork()
    if pid == 0:
        try:
            real = swap.exchange

            def exchange_then_die(a, b):
                real(a, b)
                if holder is not None and os.fork() == 0:
                    os.close(holder[1])
                    select.select([holder[0]], [], [], 60)
                    os._exit(0)
                os.kill(os.getpid(), signal.SIGKILL)

            swap.exchange = exchange_then_die
            C.compact_logdir(logdir, grace_s=0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _compacted_tables(run: Path) -> list[str]:
    return [t for t in S.TABLES if any(S.parse_data_file(p.name).compacted for p in (run / t / "r0000").iterdir())]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_lock_that_a_killed_compactions_child_still_holds_is_waited_for(small, tmp_path):
    """Killed between two tables' swaps while a process it forked still holds its lock (an flock belongs to every
    copy of the descriptor; the killed process is gone): the next compact waits for the lock and finishes the
    swap, instead of skipping the rank as written by another logger (three tables left uncompacted)."""
    run = copy_of(small, tmp_path / "log")
    r, w = os.pipe()
    _killed_after_the_first_swap(tmp_path / "log", holder=(r, w))
    os.close(r)
    assert _compacted_tables(run) == ["tokens"] and len(S.read_manifest(run)[S.COMPACTED_KEY]) == 1
    fd = os.open(run / ".r0000.lock", os.O_RDWR)
    with pytest.raises(BlockingIOError):  # held, by a process that is not the lock file's owner
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    threading.Timer(0.3, os.close, [w]).start()
    said = compact(tmp_path / "log")
    assert "skipped" not in said, said
    assert "swapped in the compacted files of flushes [1, 10] in samples, steps, summaries" in said, said
    assert _compacted_tables(run) == list(S.TABLES)
    assert all(len(list((run / t / "r0000").iterdir())) == 1 for t in S.TABLES)
    assert not (run / S.STAGING_DIR).exists() and S.validate_run(run) == []


def test_a_lock_whose_owner_lives_is_not_waited_for(tmp_path):
    """The wait is for owners that are gone only: a live owner's lock is refused at once."""
    from trustscope.runformat.errors import LogDirError
    from trustscope.runformat.locks import RunLock

    held = RunLock(tmp_path, 0)
    held.acquire("c", 0)
    try:
        started = time.monotonic()
        with pytest.raises(LogDirError, match="being written by another logger"):
            RunLock(tmp_path, 0).acquire("c", 0)
        assert time.monotonic() - started < 1.0
    finally:
        held.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_swap_that_cannot_be_finished_keeps_the_flush_files_it_would_replace(small, tmp_path):
    """Killed between two tables' swaps, and the next swap refused (a folder changed since it was staged): the
    flush files of the tables not swapped are still what readers read, so compaction keeps them (it deleted
    them, as superseded by a record whose files had not landed there); once the folder is as staged, it
    finishes."""
    run = copy_of(small, tmp_path / "log")
    expected = in_key_order(rows(run))
    _killed_after_the_first_swap(tmp_path / "log")
    (run / "samples" / "r0000" / "notes.txt").write_text("put here by hand")
    said = compact(tmp_path / "log")
    assert "cannot finish the compaction of flushes [1, 10]" in said, said
    got = in_key_order(rows(run))
    for table in S.TABLES:
        assert got[table].equals(expected[table]), table
        glob = str(run / table / "**" / "*.parquet")
        assert duckdb.sql(f"select count(*) from read_parquet('{glob}')").fetchall()[0][0] == \
            expected[table].num_rows, table
    (run / "samples" / "r0000" / "notes.txt").unlink()
    said = compact(tmp_path / "log")
    assert "swapped in the compacted files of flushes [1, 10] in samples, steps, summaries" in said, said
    assert _compacted_tables(run) == list(S.TABLES) and S.validate_run(run) == []


def test_a_swap_starts_no_process(tmp_path, monkeypatch):
    """The swap finds libc's renameat2 among the loaded symbols: no child process (ctypes.util.find_library runs
    ldconfig in one, which holds a copy of the rank's lock until it execs), once."""
    from trustscope.runformat import fsops

    def no_process(*args, **kwargs):
        raise AssertionError("a swap started a process")

    fsops._renameat2.cache_clear()
    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    monkeypatch.setattr(os, "fork", no_process)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").touch()
    fsops.exchange(tmp_path / "a", tmp_path / "b")
    assert os.listdir(tmp_path / "b") == ["x"] and os.listdir(tmp_path / "a") == []


def _state(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")
            if p.is_file()}


def test_a_full_disk_leaves_the_log_as_it_was(pristine, tmp_path, monkeypatch):
    run = copy_of(pristine, tmp_path / "log")
    before = _state(run)

    class FullDisk(pq.ParquetWriter):
        def write_table(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "ParquetWriter", FullDisk)
    result = CliRunner().invoke(app, ["compact", str(tmp_path / "log"), "--grace", "0"])
    assert result.exit_code == 1
    assert "No space left on device" in result.output and str(run / "tokens") in result.output
    assert _state(run) == before


def test_a_real_full_disk_leaves_the_log_as_it_was(pristine, tmp_path):
    """On a small tmpfs (root only) filled up but for a few KB: compaction fails naming the file."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a small tmpfs")
    try:
        run = copy_of(pristine, mount / "log")
        stats = os.statvfs(mount)
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as f:
            f.write(b"\0" * (stats.f_bavail * stats.f_frsize - 16 * 1024))
        before = _state(run)
        result = CliRunner().invoke(app, ["compact", str(mount / "log"), "--grace", "0"])
        assert result.exit_code == 1, result.output
        assert "No space left on device" in result.output and str(run) in result.output
        assert _state(run) == before
        (mount / "filler").unlink()
        compact(mount / "log")
        assert n_files(run) == 4
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_read_only_directory_leaves_the_log_as_it_was(pristine, tmp_path, monkeypatch):
    run = copy_of(pristine, tmp_path / "log")
    before = _state(run)
    real_writer = pq.ParquetWriter

    def read_only(where, *args, **kwargs):
        if os.geteuid() == 0:  # root writes anywhere: a read-only file system says this
            raise OSError(errno.EROFS, "Read-only file system", str(where))
        return real_writer(where, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetWriter", read_only)
    folders = [run, *(run / t for t in S.TABLES)]
    for folder in folders:
        folder.chmod(0o555)
    try:
        result = CliRunner().invoke(app, ["compact", str(tmp_path / "log"), "--grace", "0"])
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert result.exit_code == 1, result.output
    assert str(run / "tokens") in result.output or str(run) in result.output
    assert _state(run) == before


def test_compact_refuses_a_rank_a_live_logger_writes(pristine, tmp_path):
    copy_of(pristine, tmp_path / "log")
    with TokenLogger(tmp_path / "log", RUN, resume=True, compact_every=0):
        result = CliRunner().invoke(app, ["compact", str(tmp_path / "log"), "--grace", "0"])
    assert result.exit_code == 0 and "being written by another logger" in result.output


def test_compact_imports_no_torch(pristine, tmp_path):
    copy_of(pristine, tmp_path / "log")
    code = ("import sys; from trustscope.cli import app as main; sys.argv = ['trustscope', 'compact', sys.argv[1], "
            "'--grace', '0']\ntry:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert n_files(tmp_path / "log" / RUN) == 4


# ------------------------------------------------------------------------------------------------ S3


from test_s3 import endpoint  # noqa: E402,F401  (the moto server fixture)


@pytest.mark.filterwarnings("ignore:trustscope. object storage has no locks:UserWarning")
def test_compaction_on_s3(endpoint, tmp_path, monkeypatch):  # noqa: F811
    from trustscope import runformat
    from trustscope.db import connect

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    url = f"s3://trustscope-test/compact-{os.getpid()}"
    log_steps(url, 0, 9, compact_every=4)  # no background compaction on a store: no atomic swap there
    log_steps(url, 10, 14, resume=True)
    fs = runformat.s3_filesystem()
    names = lambda: sorted(p.rsplit("/", 1)[1] for p in fs.find(f"{url[5:]}/{RUN}/tokens"))  # noqa: E731
    assert not any(S.parse_data_file(n).compacted for n in names()) and len(names()) == 15  # one object a flush
    assert json.loads(fs.cat_file(f"{url[5:]}/{RUN}/run.json"))["logging"]["compact_every"] == 0
    assert all("/tokens/r0000/" in p for p in fs.find(f"{url[5:]}/{RUN}/tokens"))  # one folder per rank
    compact(url)
    assert [S.parse_data_file(n).compacted for n in names()] == [(1, 15)]
    tokens = f"s3://{url[5:]}/{RUN}/tokens/**/*.parquet"  # a plain reader of the prefix: each row once
    assert pq.ParquetDataset(fs.glob(tokens[5:]), filesystem=fs).read(columns=["step"]).num_rows == 15 * B * T
    with connect(url) as db:
        assert count(db, "select count(*) n from tokens") == 15 * B * T
        assert count(db, "select count(distinct step) n from steps") == 15
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 0, result.output


def test_compact_every_is_zero_or_at_least_two(tmp_path):
    for bad in (-1, 1):
        with pytest.raises(ValueError, match="compact_every"):
            TokenLogger(tmp_path, "bad", compact_every=bad)
    with pytest.raises(ValueError, match="fanin"):
        C.plan([], full=False, fanin=1)


def test_a_doctor_read_whose_files_a_compaction_swaps_away_lists_them_again(pristine, tmp_path, monkeypatch):
    """The doctor's checks (and the dashboard's Explain page, which runs them) read through a cursor whose file
    list is taken when it opens; a compaction that swaps the rank folder between that listing and the read (a live
    run with ``compact_every``, a ``trustscope compact``) leaves the listed flush files gone. The read lists the
    files again and answers as before; without that, the page showed "No such file or directory"."""
    from trustscope import doctor
    from trustscope.db import connect

    run = copy_of(pristine, tmp_path / "log")
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    with connect(run.parent) as db:
        before = doctor.measure(db, "alignment.sql")[RUN]
        opened = db.cursor
        swapped = []

        def cursor_then_compaction(**analysis):
            cur = opened(**analysis)
            if not swapped:  # the first cursor's files listed, then the folder swapped under it
                swapped.append(C.compact_logdir(run.parent, grace_s=0))
            return cur

        monkeypatch.setattr(db, "cursor", cursor_then_compaction)
        after = doctor.measure(db, "alignment.sql")[RUN]
    assert swapped and n_files(run) == len(S.TABLES)  # one compacted file a table: the listed ones are gone
    assert before["n_tokens"] == after["n_tokens"] == STEPS * B * T
    assert before.keys() == after.keys()


def test_a_contract_check_whose_files_a_compaction_swaps_away_lists_them_again(pristine, tmp_path, monkeypatch):
    """``check_contracts`` (``trustscope validate``'s view contracts) reads through :meth:`LogDB.read` like the
    doctor: a compaction that swaps the rank folder between its cursor's listing and the read is listed again, and
    the check answers as before instead of raising."""
    from trustscope.db import connect
    from trustscope.query.contracts import check_contracts

    run = copy_of(pristine, tmp_path / "log")
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    with connect(run.parent) as db:
        assert check_contracts(db, ["token_metrics"]) == []
        opened = db.cursor
        swapped = []

        def cursor_then_compaction(**analysis):
            cur = opened(**analysis)
            if not swapped:
                swapped.append(C.compact_logdir(run.parent, grace_s=0))
            return cur

        monkeypatch.setattr(db, "cursor", cursor_then_compaction)
        assert check_contracts(db, ["token_metrics"]) == []
    assert swapped and n_files(run) == len(S.TABLES)
