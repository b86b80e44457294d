"""Logging incidents (:mod:`trustscope.runformat.incidents`): a resume whose log ends before the checkpoint, a
resume on fewer or more ranks, a full disk and a dead writer never stop the training; each is one warning, a
``trustscope validate`` finding and a counter among the next step's scalars, and no committed row is lost."""

from __future__ import annotations

import errno
import json
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from trustscope import runformat as S
from trustscope.logger import LogWarning, TokenLogger
from trustscope.logger import writer as writer_module
from trustscope.runformat.incidents import INCIDENTS, incident_problems

B, T = 3, 4


def call(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lp = -rng.random((B, T)).astype(np.float32)
    return {"tokens": {"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": lp, "pi_logprob": lp,
                       "advantage": rng.normal(size=B).astype(np.float32)},
            "samples": {"prompt_id": np.arange(B)}}


def log_steps(lg: TokenLogger, steps) -> None:
    for step in steps:
        lg.log_step(step, **call(step))
        lg.commit_step()


def rows(run, table: str = "tokens") -> dict[tuple[int, int], int]:
    """(rank, step) -> committed rows of ``table``."""
    out: dict[tuple[int, int], int] = {}
    for path in S.committed_files(run)[table]:
        t = pq.read_table(path, columns=["rank", "step"]).to_pandas()
        for (rank, step), n in t.groupby(["rank", "step"]).size().items():
            out[(rank, step)] = out.get((rank, step), 0) + int(n)
    return out


def scalars(run) -> dict[tuple[int, str], float]:
    out = {}
    for path in S.committed_files(run)["steps"]:
        for row in pq.read_table(path).to_pylist():
            out[(row["step"], row["name"])] = row["value"]
    return out


def findings(run, kind: str) -> list[str]:
    return [p.message for p in S.validate_run(run) if f"logging incident {kind}" in p.message]


def test_a_resume_after_the_end_of_the_log_goes_on_with_one_warning_a_finding_and_a_counter(tmp_path):
    with TokenLogger(tmp_path, "short") as lg:
        log_steps(lg, range(3))  # steps 0-2 committed; the checkpoint the framework restores is step 5's
    before = rows(tmp_path / "short")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogWarning)
        with TokenLogger(tmp_path, "short", resume=True) as lg:
            assert lg.cut_back(5) == 0  # nothing after step 5 to cut, and no ResumeError
            log_steps(lg, range(6, 8))
            assert lg.incidents["resume_log_short"]["count"] == 1
    said = [str(w.message) for w in caught if issubclass(w.category, LogWarning)]
    assert len(said) == 1 and "rank 0 logged only up to step 2: steps 3-5 are missing" in said[0], said
    run = tmp_path / "short"
    after = rows(run)
    assert {k: v for k, v in after.items() if k[1] <= 2} == before  # no committed row lost
    assert sorted(after) == [(0, s) for s in (0, 1, 2, 6, 7)]
    found = findings(run, "resume_log_short")
    assert len(found) == 1 and "x1 seen by rank 0 (steps 5-5)" in found[0] and "steps 3-5 are missing" in found[0]
    got = scalars(run)
    assert got[(6, "trustscope/incidents/resume_log_short")] == 1.0  # with the first step logged after it
    assert (7, "trustscope/incidents/resume_log_short") not in got  # once, until the count changes


def test_a_resume_on_fewer_ranks_cuts_the_ranks_no_process_writes_and_counts_it(tmp_path):
    loggers = [TokenLogger(tmp_path, "fewer", rank=r) for r in range(3)]
    for lg in loggers:
        log_steps(lg, range(4))
    for lg in loggers:
        lg.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogWarning)
        resumed = [TokenLogger(tmp_path, "fewer", rank=r, resume=True) for r in range(2)]
        assert resumed[0].cut_back(1, world=2) > 0  # rank 0 cuts its own rows and rank 2's
        assert resumed[1].cut_back(1) > 0
        for lg in resumed:
            log_steps(lg, range(2, 4))
            lg.close()
    said = [str(w.message) for w in caught if issubclass(w.category, LogWarning)]
    assert len(said) == 1 and "resumed on 2 rank(s) after step 1; it had 3: ranks 2-2" in said[0], said
    run = tmp_path / "fewer"
    got = rows(run)
    assert sorted(got) == [(r, s) for r in range(3) for s in range(4) if r < 2 or s <= 1]
    assert all(n == B * T for n in got.values())  # the resumed steps once each
    assert len(findings(run, "resume_ranks_changed")) == 1
    assert scalars(run)[(2, "trustscope/incidents/resume_ranks_changed")] == 1.0
    assert [p for p in S.validate_run(run) if "logging incident" not in p.message] == []


def test_a_resume_on_more_ranks_and_a_cut_of_a_short_rank_are_counted_not_refused(tmp_path):
    for r in range(2):
        with TokenLogger(tmp_path, "more", rank=r) as lg:
            log_steps(lg, range(4 if r == 0 else 2))  # rank 1's log ends at step 1
    with pytest.warns(LogWarning) as caught, TokenLogger(tmp_path, "more", rank=0, resume=True) as lg:
        lg.cut_back(2, world=3, ranks={1})  # rank 1 is short of step 2: counted, its rows kept
        log_steps(lg, [3])
    said = " | ".join(str(w.message) for w in caught)
    assert "ranks 2-2 are new and start after step 2" in said and "rank 1 logged only up to step 1" in said
    run = tmp_path / "more"
    assert sorted(rows(run)) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    got = scalars(run)
    assert got[(3, "trustscope/incidents/resume_ranks_changed")] == 1.0
    assert got[(3, "trustscope/incidents/resume_log_short")] == 1.0
    manifest = json.loads((run / S.MANIFEST).read_text())
    assert set(manifest["incidents"]) == {"resume_ranks_changed", "resume_log_short"}


def test_a_full_disk_and_a_dead_writer_are_incidents_and_training_goes_on(tmp_path, monkeypatch):
    lg = TokenLogger(tmp_path, "faults", strict=False, flush_seconds=3600)
    log_steps(lg, [0])
    lg.flush()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.pq, "ParquetWriter", full)
    with pytest.warns(LogWarning, match=r"No space left on device \(logging incident rows_lost"):
        lg.log_step(1, **call(1))
        lg.flush()  # a non-strict logger warns: the training goes on
    monkeypatch.undo()
    lg.log_step(2, **call(2))  # the counter rides along
    lg.flush()

    def crash(self, heartbeat=False):
        raise MemoryError("writer thread ran out of memory")

    monkeypatch.setattr(writer_module.Writer, "_rotate", crash)
    lg.log_step(3, **call(3))
    with pytest.warns(LogWarning, match=r"writer thread .* stopped.*out of memory"):
        lg.flush()
        lg.log_step(4, **call(4))  # lost, counted; no exception
    lg.close()
    run = tmp_path / "faults"
    assert sorted(rows(run)) == [(0, 0), (0, 2)]
    assert scalars(run)[(2, "trustscope/incidents/rows_lost")] == 1.0
    manifest = json.loads((run / S.MANIFEST).read_text())
    assert manifest["incidents"]["rows_lost"]["count"] == 1 and manifest["incidents"]["writer_stopped"]["count"] == 1
    assert len(findings(run, "rows_lost")) == 1 and len(findings(run, "writer_stopped")) == 1


def test_every_incident_kind_reads_back_as_a_validate_line():
    manifest = {"rank": 3, "incidents": {i.name: {"count": 2, "first": "why", "first_step": 1, "last_step": 4}
                                         for i in INCIDENTS}}
    lines = incident_problems(manifest)
    assert len(lines) == len(INCIDENTS)
    assert all("x2 seen by rank 3 (steps 1-4): why" in line for line in lines)
    assert incident_problems({"incidents": {"nope": {}}}) == [
        f"incidents: unknown incident kind 'nope' (known: {sorted(i.name for i in INCIDENTS)})"]


def test_drop_steps_after_a_resume_past_a_short_rank_warns_and_records_it_in_that_ranks_manifest(tmp_path):
    from trustscope.logger import drop_steps_after

    for r, last in ((0, 5), (1, 2)):
        with TokenLogger(tmp_path, "cut", rank=r) as lg:
            log_steps(lg, range(last + 1))
    with pytest.warns(LogWarning, match=r"rank 1 logged only up to step 2: steps 3-4 are missing"):
        removed = drop_steps_after(tmp_path / "cut", 4, resume=True)  # a driver resuming every rank: no raise
    assert removed > 0  # rank 0's step 5 went
    run = tmp_path / "cut"
    assert sorted(rows(run)) == [(0, s) for s in range(5)] + [(1, s) for s in range(3)]
    found = findings(run, "resume_log_short")
    assert len(found) == 1 and "seen by rank 1 (steps 4-4)" in found[0]


def test_the_docs_table_is_the_declaration():
    from pathlib import Path

    from trustscope.runformat.incidents import markdown_table

    docs = (Path(__file__).parents[1] / "docs" / "logging.md").read_text()
    assert markdown_table() in docs, "docs/logging.md's incidents table differs: paste incidents.markdown_table()"
