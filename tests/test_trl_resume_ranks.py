"""A TRL GRPOTrainer run on two CPU processes (torchrun, gloo) resumed from its checkpoint on one: the rank no
process writes any more is cut back to the checkpoint like the other, the resumed steps are logged once, and the
resume on fewer processes is one warning, a ``trustscope validate`` finding and a counter in the step's scalars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trustscope import runformat as S
from trustscope.db import connect

ROOT = Path(__file__).parents[1]
SCRIPT = Path(__file__).with_name("trl_ranks_resume.py")


def torchrun(processes: int, model_dir: Path, work: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           str(SCRIPT), str(model_dir), str(work), mode], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.heavy
def test_a_trl_run_resumed_on_fewer_processes_reads_consistently(toy_model_dir, tmp_path):
    torchrun(2, toy_model_dir, tmp_path, "first")  # steps 0-2 on ranks 0 and 1; TRL's checkpoint-2 has steps 0-1
    run = tmp_path / "logs" / "ranks"

    def per_rank_step(table: str) -> dict[tuple[int, int], int]:
        with connect(run) as db:
            return {(r, s): n for r, s, n in db.cursor().execute(
                f"select rank, step, count(*) from {table} group by all").fetchall()}

    first = per_rank_step("samples")
    assert sorted(first) == [(r, s) for r in (0, 1) for s in range(3)]  # rank 1 logged step 2 too
    torchrun(1, toy_model_dir, tmp_path, "resume")  # steps 2-3 on rank 0 alone
    samples, tokens = per_rank_step("samples"), per_rank_step("tokens")
    # rank 1's step 2 (trained past the checkpoint before the resume) is cut; every other step once
    assert sorted(samples) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert {k: v for k, v in samples.items() if k[1] < 2} == {k: v for k, v in first.items() if k[1] < 2}
    with connect(run) as db:
        cur = db.cursor()
        lengths = {(r, s): n for r, s, n in cur.execute("select rank, step, sum(length) from samples group by all")
                   .fetchall()}
        assert tokens == lengths  # each token once, as many as the samples hold
        # sample ids unique within a step across ranks; every token row joins its samples row
        assert cur.execute("select count(*) - count(distinct (step, sample_id)) from samples").fetchone()[0] == 0
        assert cur.execute("select count(*) from tokens anti join samples using (step, sample_id)").fetchone()[0] == 0
        counters = cur.execute("select step, value from steps where name = "
                               "'trustscope/incidents/resume_ranks_changed'").fetchall()
    assert counters == [(2, 1.0)]
    said = json.loads((tmp_path / "resume-rank0.json").read_text())["warnings"]
    assert len(said) == 1 and "resumed on 1 rank(s) after step 1; it had 2: ranks 1-1" in said[0], said
    problems = S.validate_run(run)
    assert [p.message for p in problems if "logging incident" not in p.message] == []
    assert len([p for p in problems if "logging incident resume_ranks_changed x1" in p.message]) == 1
