"""Odd log directories: a run that is a symlink, a run with a corrupt manifest, a run with a truncated data file,
a LogDB never closed.

Each is handled the same way by validate, sql, report, the query layer and the dashboard: the symlinked run is
followed (its target read), the broken run is reported as broken, with why, while the others work (the query layer
and the dashboard show what still reads of it; sql and report leave it out and say so), and nothing is left in the
temporary directory.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from app.launch import LOGDIR_ENV
from trustscope import db as tsdb
from trustscope import runformat as S
from trustscope.cli import app
from trustscope.synthetic import SyntheticConfig, generate_run

ROOT = Path(__file__).resolve().parent.parent
CFG = SyntheticConfig(tokens=1_500, steps=2, edge_cases=False)
runner = CliRunner()


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """A log directory of one run and one symlink to a run kept elsewhere."""
    root = tmp_path_factory.mktemp("linked")
    generate_run(root / "logs", "here", CFG)
    generate_run(root / "elsewhere", "there", CFG)
    (root / "logs" / "there").symlink_to(root / "elsewhere" / "there", target_is_directory=True)
    return root / "logs"


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A log directory of two good runs and one whose run.json is cut off mid-write."""
    root = tmp_path_factory.mktemp("broken") / "logs"
    for name in ("good_a", "bad", "good_b"):
        generate_run(root, name, CFG)
    (root / "bad" / "run.json").write_text('{"run_id": "bad", "sta')
    return root


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    """Two good runs and one whose first tokens file was cut short after its flush was committed (a copy that
    stopped half-way, a full disk): the footer is gone, the other files of the run read."""
    root = tmp_path_factory.mktemp("truncated") / "logs"
    for name in ("good_a", "cut", "good_b"):
        generate_run(root, name, SyntheticConfig(tokens=1_500, steps=4, edge_cases=False, rows_per_file=600))
    files = sorted((root / "cut" / "tokens").rglob("*.parquet"))
    assert len(files) > 1, files
    with open(files[0], "r+b") as f:
        f.truncate(files[0].stat().st_size // 2)
    return root, files[0]


def _no_traceback(result):
    assert "Traceback" not in result.output and not isinstance(result.exception, duckdb.Error), result.output


def test_a_symlinked_run_is_followed_by_the_query_layer(linked):
    with tsdb.connect(linked, cache=False) as conn:
        assert conn.runs().run_id.tolist() == ["here", "there"]
        assert set(conn.step_summary().run_id) == {"here", "there"}
        counts = conn.sql("select run_id, count(*) as n from tokens group by run_id order by run_id").to_pandas()
        assert counts.run_id.tolist() == ["here", "there"] and (counts.n > 0).all()
        assert conn.sql("select count(*) as n from vocab where run_id = 'there'").table.column("n")[0].as_py() > 0


def test_a_symlinked_run_reads_nothing_else_outside(linked):
    """Following the run's link reads that run, not the folder around it."""
    outside = linked.parent / "elsewhere" / "notes.txt"
    outside.write_text("hunter2")
    with tsdb.connect(linked, cache=False) as conn:
        with pytest.raises(tsdb.QueryRefused, match="reads outside the log directory"):
            conn.sql(f"select * from read_text('{outside}')")
        with pytest.raises(Exception) as err:
            conn._run_in_sandbox(f"select * from read_text('tslog://{outside}')", 10, 10.0)
        assert "hunter2" not in str(err.value)


def test_a_symlinked_run_made_after_connect_waits_for_a_reconnect(tmp_path):
    generate_run(tmp_path / "logs", "here", CFG)
    generate_run(tmp_path / "elsewhere", "late", CFG)
    with tsdb.connect(tmp_path / "logs", cache=False) as conn:
        (tmp_path / "logs" / "late").symlink_to(tmp_path / "elsewhere" / "late", target_is_directory=True)
        assert set(conn.step_summary().run_id) == {"here"}
        assert "reopen" in conn.broken_runs["late"]
        assert conn.sql("select count(distinct run_id) as n from tokens").table.column("n")[0].as_py() == 1
    with tsdb.connect(tmp_path / "logs", cache=False) as conn:
        assert set(conn.step_summary().run_id) == {"here", "late"} and not conn.broken_runs


@pytest.mark.parametrize("command", ["validate", "sql", "report"])
def test_a_symlinked_run_works_in_every_command(linked, command):
    args = {"validate": ["validate", str(linked)],
            "sql": ["sql", str(linked), "select run_id, count(*) as n from tokens group by run_id order by 1"],
            "report": ["report", str(linked)]}[command]
    result = runner.invoke(app, args)
    _no_traceback(result)
    assert result.exit_code == 0, result.output
    assert "there" in result.output or command == "validate"


def test_a_corrupt_manifest_marks_its_run_broken_and_the_others_work(broken):
    with tsdb.connect(broken, cache=False) as conn:
        runs = conn.runs().set_index("run_id")
        assert runs.status.to_dict() == {"bad": "broken", "good_a": "finished", "good_b": "finished"}
        assert "unreadable run.json" in conn.broken_runs["bad"]
        assert set(conn.step_summary().run_id) == {"bad", "good_a", "good_b"}
        finished = conn.sql("select run_id from runs where status = 'finished' order by 1").table
        assert finished.column("run_id").to_pylist() == ["good_a", "good_b"]


@pytest.mark.parametrize("command", ["validate", "sql", "report"])
def test_a_corrupt_manifest_gives_no_traceback_anywhere(broken, command):
    args = {"validate": ["validate", str(broken)],
            "sql": ["sql", str(broken), "select run_id, status from runs order by 1"],
            "report": ["report", str(broken)]}[command]
    result = runner.invoke(app, args)
    _no_traceback(result)
    if command == "validate":
        assert result.exit_code == 1 and "bad/run.json: unreadable run manifest" in result.output
    else:
        assert result.exit_code == 0, result.output
        assert "good_a" in result.output and "good_b" in result.output


def test_a_truncated_file_marks_its_run_broken_and_the_rest_reads(truncated):
    root, cut = truncated
    with tsdb.connect(root, cache=False) as conn:
        assert cut.name in conn.broken_runs["cut"] and "not a readable Parquet file" in conn.broken_runs["cut"]
        assert conn.runs().set_index("run_id").status.to_dict() == {
            "cut": "broken", "good_a": "finished", "good_b": "finished"}
        steps = conn.step_summary()
        kept = pq.read_table(S.run_of(cut).parent / "good_a" / "tokens").num_rows
        assert steps.groupby("run_id").n_tokens.sum()["good_a"] == kept
        read = conn.sql("select count(*) as n from tokens where run_id = 'cut'").table.column("n")[0].as_py()
        others = [f for f in sorted(cut.parent.glob("*.parquet")) if f != cut]
        assert read == sum(pq.read_metadata(f).num_rows for f in others) > 0
        assert steps.groupby("run_id").n_tokens.sum()["cut"] == read


@pytest.mark.parametrize("command", ["sql", "report", "doctor"])
def test_a_truncated_file_leaves_its_run_out_of_the_cli_and_says_so(truncated, command):
    """sql and report answer for the other runs; doctor checks them too and exits 2, since one run went
    unchecked."""
    root, cut = truncated
    args = {"sql": ["sql", str(root), "select distinct run_id from tokens order by 1"],
            "report": ["report", str(root)], "doctor": ["doctor", str(root)]}[command]
    result = runner.invoke(app, args)
    _no_traceback(result)
    assert result.exit_code == (2 if command == "doctor" else 0), result.output
    said = "cut: left out" if command == "report" else "run cut left out"
    assert said in result.output and cut.name in result.output
    assert "good_a" in result.output and "good_b" in result.output


@pytest.mark.parametrize("which", ["linked", "broken", "truncated"])
def test_the_dashboard_shows_odd_logdirs(monkeypatch, request, which):
    logdir = request.getfixturevalue(which)
    logdir = logdir[0] if which == "truncated" else logdir
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=60)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    shown = set(at.dataframe[0].value["run_id"])
    if which == "linked":
        assert not at.error and shown == {"here", "there"}
    else:
        bad = "bad" if which == "broken" else "cut"
        assert [e.value.split(":")[0] for e in at.error] == [f"Could not read all of run `{bad}`"]
        assert {"good_a", "good_b", bad} <= shown
        status = at.dataframe[0].value.set_index("run_id")["status"].to_dict()
        assert status[bad] == "broken" and status["good_a"] == status["good_b"] == "finished"


def test_a_logdb_never_closed_leaves_no_temporary_folder(broken):
    conn = tsdb.connect(broken, cache=False)
    conn.sql("select 1")
    private, worker = conn._private, conn._resources.sandbox._proc
    assert private.is_dir()
    del conn
    gc.collect()
    assert not private.exists()
    assert worker.poll() is not None


def test_a_process_that_exits_without_closing_leaves_nothing(broken, tmp_path):
    script = ("import sys; from trustscope import db\n"
              "conn = db.connect(sys.argv[1], cache=False); conn.sql('select 1'); print(conn._private)\n"
              "keep = [conn]\n")  # still referenced at exit: the finaliser runs at interpreter exit
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script, str(broken)], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    private = Path(out.stdout.strip())
    assert private.name.startswith("trustscope-db-") and not private.exists()
