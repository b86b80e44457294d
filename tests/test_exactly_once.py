"""Every reader sees every committed row exactly once: DuckDB, pyarrow.dataset, pandas and polars reading a run's
folders with their own code count the rows logged, per step, after close, while the logger logs and compacts, and
after SIGKILLs at random moments; ``validate`` names what only they would read, and ``--repair`` removes it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from plain_readers import READERS, step_counts, trustscope_counts
from typer.testing import CliRunner

from trustscope import runformat as S
from trustscope.cli import app
from trustscope.logger import TokenLogger
from trustscope.runformat.maintenance import repair_run

B, T = 8, 16
WRITER = Path(__file__).with_name("crash_writer.py")


def log(logdir: Path, run_id: str, first: int, last: int, **options) -> None:
    """Steps ``first..last`` of B x T tokens, a flush after every step (compaction as the logger's default)."""
    with TokenLogger(logdir, run_id, resume=first > 0, fsync=False, **options) as lg:
        for step in range(first, last + 1):
            rng = np.random.default_rng(step)
            lp = -rng.random((B, T)).astype(np.float32)
            lg.log_step(step, tokens={"token_id": rng.integers(0, 50, (B, T)), "mu_logprob": lp, "pi_logprob": lp,
                                      "advantage": rng.normal(size=B)},
                        mask=np.ones((B, T), dtype=bool),
                        samples={"sample_id": np.arange(B), "prompt_id": np.arange(B) // 2}, scalars={"loss": 1.0})
            lg.flush()


def expected(steps: range) -> dict[str, dict[int, int]]:
    return {"tokens": dict.fromkeys(steps, B * T), "samples": dict.fromkeys(steps, B), "steps": dict.fromkeys(steps, 1)}


def test_after_close_every_reader_counts_each_step_once(tmp_path):
    log(tmp_path, "run", 0, 39)  # compact_every=10 (the default): 4 compactions
    run = tmp_path / "run"
    manifest = S.read_manifest(run)
    assert manifest[S.LAYOUT_KEY] == S.LAYOUT and len(manifest[S.COMPACTED_KEY]) == 4
    want = expected(range(40))
    for table in ("tokens", "samples", "steps"):
        assert trustscope_counts(run, table) == want[table]
        for reader in READERS:
            assert step_counts(run, table, reader)[0] == want[table], (reader, table)
    # the readable set is exactly what trustscope reads: nothing superseded or temporary is left anywhere
    assert S.readable_set(run) == S.committed_files(run)
    assert not (run / S.SUPERSEDED_DIR).exists() and not (run / S.STAGING_DIR).exists()
    listed = sum(len(names) for t in S.TABLES for names in S.table_listing(run, t).values())
    assert listed == sum(len(files) for files in S.committed_files(run).values())  # opening lists live files only
    assert S.validate_run(run) == []


def test_readers_racing_the_logger_and_its_compactions_never_count_wrong(tmp_path):
    """A reader thread loops over the four readers while a logger flushes every step and compacts every 4 flushes:
    at every moment each reader sees each step it sees whole, once, and the steps form a prefix."""
    run = tmp_path / "race"
    views: dict[str, int] = dict.fromkeys(READERS, 0)
    seen: dict[str, int] = dict.fromkeys(READERS, 0)  # steps each reader has seen so far: a view never shrinks
    retried, errors, stop = [0], [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            for reader in READERS:
                if not (run / S.MANIFEST).exists():
                    continue
                try:
                    counts, again = step_counts(run, "tokens", reader)
                except Exception as err:
                    errors.append((reader, err))
                    continue
                retried[0] += again
                steps = sorted(counts)
                # an empty view, or one with fewer steps than an earlier one, is a table (or its files) vanished
                if (len(steps) < seen[reader] or steps != list(range(len(steps)))
                        or (counts and set(counts.values()) != {B * T})):
                    errors.append((reader, f"{len(steps)} steps after {seen[reader]}", counts))
                seen[reader] = max(seen[reader], len(steps))
                views[reader] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        log(tmp_path, "race", 0, 59, compact_every=4)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:3]
    assert min(views.values()) >= 3, views
    assert min(seen.values()) > 0, seen  # every reader saw rows while the logger ran, so shrinking was checked
    rounds = json.loads((run / S.MANIFEST).read_text())[S.COMPACTED_KEY]
    assert rounds and all(step_counts(run, "tokens", r)[0] == expected(range(60))["tokens"] for r in READERS)


def _kill_and_check(tmp_path: Path, kills: int, seed: int) -> dict[str, int]:
    """Log with compaction on in a subprocess, SIGKILL it at random moments ``kills`` times (each time resuming the
    run), and after each kill compare every reader's rows per step with trustscope's and with the steps the
    writer reported flushed. Returns what happened: kills that needed a repair, reads retried."""
    rng = random.Random(seed)
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "CRASH_WRITER_COMPACT_EVERY": "3"}
    reported: set[int] = set()
    seen = {"repaired": 0, "retried": 0}
    for _ in range(kills):
        first = max(trustscope_counts(run, "tokens"), default=-1) + 1
        proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path), "killed", str(first)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        for _ in range(rng.randint(4, 8)):  # a random number of flushes (every third starts a compaction), then
            line = proc.stdout.readline()   # a random moment
            assert line.startswith("flushed"), line
            reported.add(int(line.split()[1]))
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        reported |= {int(line.split()[1]) for line in out.splitlines() if line.startswith("flushed")}
        strays = S.stray_files(run)
        assert all("not all its files are in place" in s.why for s in strays), strays  # the one stated window
        if strays or any("the run's" in p.message for p in S.validate_run(run)):
            assert repair_run(run)
            seen["repaired"] += 1
        ours = {t: trustscope_counts(run, t) for t in S.TABLES}
        assert reported <= set(ours["tokens"]), "a flushed step was lost"
        assert set(ours["tokens"].values()) <= {8 * 16} and sorted(ours["tokens"]) == list(range(len(ours["tokens"])))
        for table in S.TABLES:
            for reader in READERS:
                counts, again = step_counts(run, table, reader)
                assert counts == ours[table], (reader, table)
                seen["retried"] += again
        assert S.validate_run(run) == []
    return seen


def test_sigkill_at_random_moments_with_compaction_on(tmp_path):
    seen = _kill_and_check(tmp_path, kills=2, seed=1)
    assert S.read_manifest(tmp_path / "killed").get(S.COMPACTED_KEY), "the kills should have let compactions run"
    assert seen["retried"] == 0  # nothing races a read after the kill


@pytest.mark.slow
@pytest.mark.heavy
def test_sigkill_fifty_times_with_compaction_on(tmp_path):
    _kill_and_check(tmp_path, kills=50, seed=2)


def test_validate_names_stray_files_and_repair_removes_only_what_is_provably_superseded(tmp_path):
    log(tmp_path, "run", 0, 9, compact_every=0)
    run = tmp_path / "run"
    folder = run / "tokens" / S.rank_dir_name(0)
    flush_files = sorted(folder.iterdir())
    kept = {p: p.read_bytes() for p in flush_files}
    log(tmp_path, "run", 10, 10, compact_every=0)
    from trustscope.runformat.maintenance import compact_logdir

    compact_logdir(tmp_path, grace_s=0)
    superseded = flush_files[3]
    superseded.write_bytes(kept[superseded])  # a flush file its compacted file replaced, back (restored by hand)
    orphan = folder / S.data_file_name(0, 99, 99, 99)  # a flush its manifest never committed
    orphan.write_bytes(kept[flush_files[0]])
    by_hand = folder / "extra.parquet"  # a file the logger never writes
    by_hand.write_bytes(kept[flush_files[1]])
    result = CliRunner().invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    for path in (superseded, orphan, by_hand):
        assert f"{path}: read by tools that list the folder" in result.output, result.output
    assert "superseded: its rows are in the compacted file" in result.output
    assert "which its manifest never committed" in result.output
    assert trustscope_counts(run, "tokens") == expected(range(11))["tokens"]  # read as the manifests say
    assert step_counts(run, "tokens", "duckdb")[0] != expected(range(11))["tokens"]  # what the strays cost
    result = CliRunner().invoke(app, ["validate", "--repair", str(tmp_path)])
    assert f"removed {superseded}" in result.output and f"removed {orphan}" in result.output, result.output
    assert f"kept {by_hand}" in result.output
    assert not superseded.exists() and not orphan.exists() and by_hand.exists()
    by_hand.unlink()
    assert CliRunner().invoke(app, ["validate", str(tmp_path)]).exit_code == 0
    assert step_counts(run, "tokens", "polars")[0] == expected(range(11))["tokens"]


def test_a_compaction_killed_before_its_swap_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    from trustscope.runformat import compaction

    log(tmp_path, "run", 0, 5, compact_every=0)
    run = tmp_path / "run"

    def killed(*args, **kwargs):  # the record is saved, the staged folders wait: the process dies here
        raise KeyboardInterrupt

    monkeypatch.setattr(compaction, "swap_in", killed)
    with pytest.raises(KeyboardInterrupt):
        S.compact_logdir(tmp_path, grace_s=0)
    monkeypatch.undo()
    assert (run / S.STAGING_DIR).is_dir() and S.read_manifest(run)[S.COMPACTED_KEY]
    for reader in READERS:  # the record is saved, its files not yet in place: the flush files are read
        assert step_counts(run, "tokens", reader)[0] == expected(range(6))["tokens"]
    assert trustscope_counts(run, "tokens") == expected(range(6))["tokens"]
    log(tmp_path, "run", 6, 6, compact_every=0)  # the next writer swaps the staged folders in
    assert not (run / S.STAGING_DIR).exists()
    names = sorted(p.name for p in (run / "tokens" / S.rank_dir_name(0)).iterdir())
    assert [S.parse_data_file(n).compacted for n in names] == [(1, 6), None], names
    for reader in READERS:
        assert step_counts(run, "tokens", reader)[0] == expected(range(7))["tokens"]
    assert S.validate_run(run) == []


def test_the_compactions_folder_swap_leaves_no_moment_without_the_rank_folder(tmp_path):
    """The swap itself, watched directly: a thread lists each table's live rank folder in a tight loop while
    compactions swap the staged folders in. At every moment the folder is there and holds the flush files or the
    compacted file (never neither, never a mix), so a plain reader can never see a table vanish."""
    if not S.can_exchange(tmp_path):
        pytest.skip("this file system cannot swap two folders in one step (the compaction does not swap here)")
    run = tmp_path / "run"
    log(tmp_path, "run", 0, 5, compact_every=0)
    folders = {t: run / t / S.rank_dir_name(0) for t in S.TABLES}
    views: dict[str, set[frozenset[str]]] = {t: set() for t in S.TABLES}
    gaps: list[str] = []
    polls, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for table, folder in folders.items():
                try:
                    names = frozenset(n for n in os.listdir(folder) if n.endswith(".parquet"))
                except FileNotFoundError:
                    gaps.append(f"{folder} missing")
                    continue
                if not names:
                    gaps.append(f"{folder} empty")
                views[table].add(names)
            polls[0] += 1

    for first, last in ((6, 8), (9, 11)):  # two compactions, each of every flush so far
        before = {t: frozenset(os.listdir(f)) for t, f in folders.items()}
        poller = threading.Thread(target=poll)
        stop.clear()
        poller.start()
        try:
            while polls[0] < 10:
                time.sleep(0.001)
            S.compact_logdir(tmp_path, grace_s=0)
            start = polls[0]
            while polls[0] < start + 10:
                time.sleep(0.001)
        finally:
            stop.set()
            poller.join()
        after = {t: frozenset(os.listdir(f)) for t, f in folders.items()}
        assert not gaps, gaps[:3]
        for table in S.TABLES:
            assert before[table] != after[table] and len(after[table]) == 1, (before[table], after[table])
            assert views[table] <= {before[table], after[table]}, views[table]  # old files or new, never a mix
            assert after[table] in views[table], "the poller saw the swap happen"
            views[table].clear()
        log(tmp_path, "run", first, last, compact_every=0)
    for reader in READERS:
        assert step_counts(run, "tokens", reader)[0] == expected(range(12))["tokens"]


def test_old_flat_runs_read_as_before_and_a_resumed_one_stays_flat(tmp_path, legacy_logs):
    (run,) = S.run_dirs(legacy_logs)
    old = Path(shutil.copytree(run, tmp_path / run.name))
    assert S.layout_of(S.read_manifest(old)) == 1
    for reader in READERS:
        assert step_counts(old, "samples", reader)[0] == trustscope_counts(old, "samples")
    last = S.read_manifest(old)["last_step"]
    before = trustscope_counts(old, "tokens")
    log(tmp_path, old.name, last + 1, last + 3)  # compaction asked for (the default), but no folder to swap
    manifest = S.read_manifest(old)
    assert S.layout_of(manifest) == 1 and manifest["logging"]["compact_every"] == 0
    assert not any(p.is_dir() for t in S.TABLES for p in (old / t).iterdir())
    want = {**before, **dict.fromkeys(range(last + 1, last + 4), B * T)}
    for reader in READERS:
        assert step_counts(old, "tokens", reader)[0] == want, reader
    assert S.validate_run(old) == []


from test_s3 import endpoint  # noqa: E402,F401  (the moto server fixture)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:trustscope. object storage has no locks:UserWarning")
def test_on_s3_a_listing_of_the_prefix_reads_each_row_once_and_strays_are_named(endpoint, tmp_path,  # noqa: F811
                                                                                 monkeypatch):
    import pyarrow.parquet as pq

    from trustscope import runformat

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    url = f"s3://trustscope-test/once-{os.getpid()}"
    log(url, "run", 0, 11)  # compact_every=10 asked (the default): no background compaction on a store
    fs = runformat.s3_filesystem()
    prefix = f"{url[5:]}/run/tokens"

    def listed_rows() -> int:  # a plain reader of the prefix: every object under it, recursively
        return pq.ParquetDataset(fs.glob(f"{prefix}/**/*.parquet"), filesystem=fs).read(columns=["step"]).num_rows

    assert listed_rows() == 12 * B * T
    objects = sorted(fs.glob(f"{prefix}/**/*.parquet"))
    stray = f"{prefix}/{S.rank_dir_name(0)}/{S.data_file_name(0, 99, 99, 99)}"  # a flush never committed
    fs.copy(objects[0], stray)
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 1 and f"s3://{stray}: read by tools that list the prefix" in result.output
    result = CliRunner().invoke(app, ["compact", url, "--grace", "0"])
    assert result.exit_code == 0, result.output
    assert not fs.exists(stray) and listed_rows() == 12 * B * T
    assert [S.parse_data_file(p.rsplit("/", 1)[1]).compacted for p in fs.glob(f"{prefix}/**/*.parquet")] == [(1, 12)]
    assert CliRunner().invoke(app, ["validate", url]).exit_code == 0
