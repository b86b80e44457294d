"""A run whose rank 0 never logged (ranks >= 1 wrote their manifests and rows, no ``run.json``) reads the same
through every entry, given its log directory or its run directory: ``connect`` reads its rows and names it broken
(the missing ``run.json``), ``trustscope sql``, ``report`` and ``doctor`` refuse it with a non-zero exit naming the
missing manifest, and the dashboard shows what reads of it marked broken, naming the manifest. Never an empty run
with exit 0."""

from __future__ import annotations

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest
from test_app import MAIN, TIMEOUT
from typer.testing import CliRunner

from app.launch import LOGDIR_ENV
from trustscope.cli import app
from trustscope.db import connect
from trustscope.logger import TokenLogger

B, T, STEPS = 3, 4, 3
MISSING = "run.json is missing: rank 0 never wrote the run's manifest (rank(s) 1, 2 logged)"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("no-rank0")
    for rank in (1, 2):
        with TokenLogger(root, "headless", rank=rank) as lg:
            for step in range(STEPS):
                rng = np.random.default_rng(10 * rank + step)
                lp = -rng.random((B, T)).astype(np.float32)
                lg.log_step(step, tokens={"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": lp,
                                          "pi_logprob": lp - 0.01, "advantage": rng.normal(size=B).astype(np.float32)},
                            samples={"prompt_id": np.arange(B)}, scalars={"loss": float(step)})
    assert not (root / "headless" / "run.json").exists()
    return root


@pytest.mark.parametrize("where", ["logdir", "run"])
def test_connect_reads_the_same_rows_and_names_the_missing_manifest(logdir, where):
    path = logdir if where == "logdir" else logdir / "headless"
    with connect(path) as db:
        assert list(db.broken_runs) == ["headless"]
        assert MISSING in db.broken_runs["headless"]
        rows = db.cursor().execute("select rank, step, count(*) from tokens group by all order by all").fetchall()
    assert rows == [(r, s, B * T) for r in (1, 2) for s in range(STEPS)]


@pytest.mark.parametrize("where", ["logdir", "run"])
@pytest.mark.parametrize("command", [["sql", "{path}", "select count(*) from tokens"], ["report", "{path}"],
                                     ["doctor", "{path}"]], ids=["sql", "report", "doctor"])
def test_every_command_refuses_it_naming_the_missing_manifest(logdir, where, command):
    path = str(logdir if where == "logdir" else logdir / "headless")
    result = CliRunner().invoke(app, [a.format(path=path) for a in command])
    assert result.exit_code != 0, result.output
    assert MISSING in result.output, result.output


@pytest.mark.slow
@pytest.mark.parametrize("where", ["logdir", "run"])
def test_the_dashboard_shows_it_broken_naming_the_missing_manifest(logdir, where, monkeypatch):
    monkeypatch.setenv(LOGDIR_ENV, str(logdir if where == "logdir" else logdir / "headless"))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    shown = " ".join(e.value for e in [*at.error, *at.warning])
    assert MISSING in shown, shown
