"""SIGKILL a logging process at random moments, many times: what is left is always readable and honest."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from plain_readers import READERS, step_counts, trustscope_counts

from trustscope import runformat as S
from trustscope.logger import rank_statuses, run_status
from trustscope.runformat.maintenance import repair_run

WRITER = Path(__file__).with_name("crash_writer.py")
ROWS_PER_STEP = 8 * 16  # B * T in crash_writer.py
KILLS = 10


def steps_on_disk(run_dir: Path, table: str = "tokens") -> dict[int, int]:
    """Rows per step of ``table`` as a reader sees them (committed flushes only)."""
    files = S.committed_files(run_dir)[table]
    if not files:
        return {}
    data = ds.dataset(files, format="parquet").to_table(columns=["step"])
    counts = data.group_by("step").aggregate([([], "count_all")])
    return dict(zip(counts["step"].to_pylist(), counts["count_all"].to_pylist(), strict=True))


def assert_whole_steps(run_dir: Path) -> int:
    """Every step a reader sees is in every table, and the manifest counts exactly what a reader sees; DuckDB,
    pyarrow, pandas and polars reading the folders count the same rows per step. A writer killed while it renamed
    a committed flush's files into place leaves some of them in the folders (the one window, which validate names):
    they are put in place by ``validate --repair`` first. Returns how many files that repair put in place."""
    strays = S.stray_files(run_dir)
    assert all("not all its files are in place" in s.why for s in strays), strays
    repaired = 0
    problems = S.validate_run(run_dir)
    if problems:  # killed between a commit and the last rename: some of the flush's files still to put in place
        assert {s.path for s in strays} <= {p.path for p in problems}, "validate names each file only tools read"
        assert all("not all its files are in place" in p.message or "the run's" in p.message for p in problems)
        said = repair_run(run_dir)
        repaired = sum("renamed" in line for line in said)
        assert repaired and not S.stray_files(run_dir), said
    for table in S.TABLES:
        ours = trustscope_counts(run_dir, table)
        for reader in READERS:
            assert step_counts(run_dir, table, reader)[0] == ours, (reader, table)
    tokens, samples, steps, summaries = (steps_on_disk(run_dir, t) for t in S.TABLES)
    assert set(tokens) == set(samples) == set(steps) == set(summaries), (sorted(tokens), sorted(samples),
                                                                         sorted(steps), sorted(summaries))
    assert set(tokens.values()) <= {ROWS_PER_STEP} and set(samples.values()) <= {ROWS_PER_STEP // 16}
    manifest = S.read_manifest(run_dir)
    assert manifest["rows"] == {t: sum(c.values()) for t, c in zip(S.TABLES, (tokens, samples, steps, summaries),
                                                                          strict=True)}
    assert S.validate_run(run_dir) == []
    return repaired


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_readable_honest_logs(tmp_path):
    rng = random.Random(0)
    run_dir = tmp_path / "crashy"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    reported: set[int] = set()
    seen: dict[Path, int] = {}  # file -> size, checked already
    for kill in range(KILLS):
        on_disk = steps_on_disk(run_dir)
        first = max(on_disk, default=-1) + 1
        proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path), "crashy", str(first)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
        if kill % 3:  # two kills in three come after some progress, at a random moment; one right after start
            line = proc.stdout.readline()
            assert line.startswith("flushed"), line
            reported.add(int(line.split()[1]))
            time.sleep(rng.uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        flushed = [line.split() for line in out.splitlines() if line.startswith("flushed")]
        reported |= {int(step) for _, step, _ in flushed}

        # every file a reader sees is whole Parquet of the right schema, and stays as it was; temporary files
        # never match the glob (renamed files of a flush that was never committed are not read, see below)
        assert all(S.is_data_file(p) for p in run_dir.rglob("*.parquet"))
        visible = sorted(p for files in S.committed_files(run_dir).values() for p in files)
        visible += [run_dir / S.VOCAB_FILE] if (run_dir / S.VOCAB_FILE).exists() else []
        assert all(p.stat().st_size == size for p, size in seen.items()), "a committed file changed or went"
        for path in visible:
            if path not in seen:
                assert S.validate_file(path, S.table_of(path) if path.parent != run_dir else "vocab", "crashy") == []
                seen[path] = path.stat().st_size
        # at most the unflushed steps are missing, and no step is partial
        on_disk = steps_on_disk(run_dir)
        assert reported <= set(on_disk), f"flushed steps lost after kill {kill}"
        assert set(on_disk.values()) <= {ROWS_PER_STEP}
        assert sorted(on_disk) == list(range(len(on_disk))), "steps on disk form a prefix"
        assert_whole_steps(run_dir)
        # the manifest says the run did not finish cleanly
        assert run_status(run_dir) == "crashed"
        assert rank_statuses(run_dir) == {0: "crashed"}
    assert len(reported) >= 3, "the writer was killed too early to test anything"
    assert S.validate_logdir(tmp_path) == []
    manifest = S.read_manifest(run_dir)
    assert manifest["status"] == "running"  # as left by the dead writer; run_status reads it as crashed
    assert len(manifest["resumes"]) >= 1


@pytest.mark.slow
def test_sigkill_between_the_renames_of_a_flush_shows_whole_steps_or_none(tmp_path):
    from trustscope.db import connect

    run_dir = tmp_path / "torn"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    hidden = 0
    for kill_after in (1, 2, 3, 5, 6, 7):  # within the 1st flush, after its renames, within/after later ones
        first = max(steps_on_disk(run_dir), default=-1) + 1
        proc = subprocess.run([sys.executable, str(WRITER), str(tmp_path), "torn", str(first), str(kill_after)],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        flushed = {int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("flushed")}
        assert flushed <= set(steps_on_disk(run_dir)), "a flush that returned was lost"
        hidden += assert_whole_steps(run_dir)  # committed, partly in place: hidden until repaired
        assert run_status(run_dir) == "crashed"
    assert hidden >= 3, "the kills should have left committed flushes partly in place"
    with connect(tmp_path) as db:
        seen = tuple(db.sql("select count(distinct step) as n, count(*) as n_rows from tokens").table.to_pylist()[0].values())
        scalars = tuple(db.sql("select count(distinct step) as n from steps").table.to_pylist()[0].values())
    assert seen == (len(steps_on_disk(run_dir)), sum(steps_on_disk(run_dir).values()))
    assert scalars[0] == seen[0]
