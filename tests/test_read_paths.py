"""Reading logs imports no torch, transformers or vLLM: every read command, the query layer and the dashboard, each
in a fresh interpreter with its ``sys.modules`` read at the end. The trainer's libraries take seconds to import, and
a reader's install need not have them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_importers_cli import WRITERS

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_LOGS = ROOT / "sample_logs"
HEAVY = ("torch", "transformers", "vllm")

RUN_CLI = """
import contextlib, io, json, sys
sys.argv = ["trustscope", *json.loads(sys.argv[1])]
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    from trustscope import cli, sql_command
    sql_command.ONE_SHOT = True  # as the console script runs it (trustscope.entry)
    try:
        cli.app()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY),
                  "pandas": "pandas" in sys.modules, "output": out.getvalue()[-2000:]}))
""".replace("HEAVY", repr(HEAVY))


def run_cli(args: list[str], cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN_CLI, json.dumps(args)], capture_output=True, text=True,
                          cwd=ROOT, env={**_env(), "TRUSTSCOPE_CACHE": str(cache)}, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "TRUSTSCOPE_RULES"}


# codes: the exit codes the command's contract allows on sample_logs. Only doctor's contract has more than 0: 1 when
# a check fails, 2 when a run cannot be read whole (docs/cli.md); 2 is also click's usage error, told apart below.
@pytest.mark.parametrize(("args", "pandas", "codes"), [  # pandas: may it import pandas
    (["--help"], False, {0}),
    (["version"], False, {0}),
    (["sql", str(SAMPLE_LOGS), "select rule, count(*) from blocked_fractions group by rule"], False, {0}),
    (["validate", str(SAMPLE_LOGS)], True, {0}),  # pyarrow's compute functions import pandas to wrap a Python number
    (["doctor", str(SAMPLE_LOGS)], False, {0, 1, 2}),
    (["report", str(SAMPLE_LOGS)], True, {0}),  # the report's tables are DataFrames
    (["import", "--help"], False, {0}),
    (["doctor", "--help"], False, {0}),
    (["dashboard", "--help"], False, {0}),
], ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else None)
def test_read_commands_import_no_trainer_library(args, pandas, codes, tmp_path):
    result = run_cli(args, tmp_path / "cache")
    assert result["code"] in codes, result["output"]
    assert "Usage:" not in result["output"] or args[-1] == "--help", result["output"]  # never a usage error
    assert result["modules"] == [], f"{args[0]} imported {result['modules']}"
    if not pandas:
        assert not result["pandas"], f"{args[0]} imported pandas, which it has no use for"


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl"])
def test_importing_json_lines_imports_no_trainer_library(fmt, tmp_path):
    WRITERS[fmt](tmp_path / "src")
    result = run_cli(["import", fmt, str(tmp_path / "src"), str(tmp_path / "logs"), "--run-id", "r"],
                     tmp_path / "cache")
    assert result["code"] == 0, result["output"]
    assert (tmp_path / "logs" / "r" / "run.json").is_file()
    assert result["modules"] == [], result["modules"]


QUERY_LAYER = """
import json, sys
from trustscope.db import connect
db = connect(sys.argv[1])
shown = {"steps": len(db.step_summary()), "overview": len(db.overview().steps), "rules": len(db.rules()),
         "clipped": len(db.clipped_tokens(top=3)), "sql": db.sql("select count(*) as n from tokens").table.num_rows}
print(json.dumps({"shown": shown, "modules": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
""".replace("HEAVY", repr(HEAVY))


def test_the_query_layer_and_its_analyses_import_no_trainer_library(tmp_path):
    done = subprocess.run([sys.executable, "-c", QUERY_LAYER, str(SAMPLE_LOGS)], capture_output=True, text=True,
                          cwd=ROOT, env={**_env(), "TRUSTSCOPE_CACHE": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(n > 0 for n in result["shown"].values()), result["shown"]
    assert result["modules"] == [], result["modules"]


DASHBOARD = """
import json, os, sys
from streamlit.testing.v1 import AppTest
from app.pages import PAGES
for page in PAGES:
    at = AppTest.from_file(os.path.join(sys.argv[1], "app", "main.py"), default_timeout=120)
    if not page.default:
        at.switch_page(page.script)
    at.run()
    assert not at.exception, (page.file, [e.message for e in at.exception])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)))
""".replace("HEAVY", repr(HEAVY))


@pytest.mark.slow
def test_every_dashboard_page_imports_no_trainer_library(tmp_path):
    done = subprocess.run([sys.executable, "-c", DASHBOARD, str(ROOT)], capture_output=True, text=True, cwd=ROOT,
                          env={**_env(), "TRUSTSCOPE_CACHE": str(tmp_path), "TRUSTSCOPE_LOGDIR": str(SAMPLE_LOGS)},
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
