"""Every ``trustscope`` command through its command line: output on stdout, errors on stderr with an exit code."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from trustscope import __version__
from trustscope.cli import app
from trustscope.runformat.validation import validate_run
from trustscope.synthetic import SyntheticConfig, generate_run
from trustscope.train.config import TrainConfig

runner = CliRunner()
COMMANDS = ["version", "dashboard", "train", "demo", "validate", "sql", "report"]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "logs"
    generate_run(root, "run0", SyntheticConfig(tokens=1_500, steps=2, edge_cases=False))
    return root


def test_version():
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.output.strip() == __version__


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    listed = [line.split()[1] for line in result.output.splitlines() if line.startswith("│ ") and
              line.split()[1] in COMMANDS]
    assert listed == COMMANDS


# ---------------------------------------------------------------------------------------------- train


def test_train_has_an_option_per_config_field_with_its_docstring():
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in result.output, flag
    assert "--no-std-normalize" in result.output and "Stale rollouts, as in asynchronous RL" in result.output


@pytest.fixture
def captured(monkeypatch):
    """The TrainConfig ``trustscope train`` would train with (the training itself is not run)."""
    import trustscope.train.loop as loop

    seen = []
    monkeypatch.setattr(loop, "train_with_progress", seen.append)
    return seen


def test_train_options_reach_the_config_typed(captured, tmp_path):
    result = runner.invoke(app, ["train", "--lr", "1e-5", "--std-normalize", "--no-log-tokens", "--steps", "3",
                                 "--adam-betas", "0.9,0.99", "--loss", "dppo_binary_kl", "--loss-params",
                                 '{"delta": 0.1}', "--engine-dtype=bfloat16", "--logdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert (cfg.lr, cfg.std_normalize, cfg.log_tokens, cfg.steps, cfg.adam_betas, cfg.loss_params,
            cfg.engine_dtype) == (1e-5, True, False, 3, (0.9, 0.99), {"delta": 0.1}, "bfloat16")
    assert cfg.recompute_old is False and cfg.group_size == TrainConfig.group_size  # untouched fields: defaults


def test_train_options_override_the_config_file(captured, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"steps": 7, "lr": 1e-4, "std_normalize": True}))
    result = runner.invoke(app, ["train", "--config", str(path), "--steps", "9", "--no-std-normalize"])
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert (cfg.steps, cfg.lr, cfg.std_normalize) == (9, 1e-4, False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "fast"], "lr='fast': expected a number"),
        (["--steps", "0"], "steps=0: set steps to a value >= 1"),
        (["--loss", "minirl"], "set recompute_old=true"),
        (["--loss-params", "{oops"], "loss_params='{oops': expected a JSON object"),
        (["--lrr", "1"], "No such option: --lrr"),
    ],
)
def test_train_bad_options_exit_2_naming_the_field(captured, args, message):
    result = runner.invoke(app, ["train", *args], terminal_width=200)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not captured


def test_train_list_options():
    result = runner.invoke(app, ["train", "--list-options"], terminal_width=200)
    assert result.exit_code == 0 and "--policy-lag" in result.output


def test_train_refuses_an_existing_run(tmp_path, toy_model_dir):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "run.json").write_text("{}")
    result = runner.invoke(app, ["train", "--logdir", str(tmp_path), "--run-id", "taken", "--engine", "hf"])
    assert result.exit_code == 2 and "already exists" in result.output


@pytest.mark.slow
def test_train_one_step(tmp_path, toy_model_dir):
    result = runner.invoke(app, ["train", "--engine", "hf", "--steps", "1", "--eval-every", "0", "--group-size", "2",
                                 "--prompts-per-step", "2", "--threads", "1", "--logdir", str(tmp_path),
                                 "--run-id", "one"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert validate_run(tmp_path / "one") == []


# ---------------------------------------------------------------------------------------------- the others


def test_demo_hands_its_options_on(monkeypatch, tmp_path):
    import trustscope.demo as demo

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: seen.append((a, k)))
    result = runner.invoke(app, ["demo", "--no-serve", "--steps", "2", "--logdir", str(tmp_path), "--port", "9000"])
    assert result.exit_code == 0, result.output
    assert seen == [((tmp_path,), {"steps": 2, "serve": False, "port": 9000, "samples": True, "seed": 0})]
    result = runner.invoke(app, ["demo", "--no-serve", "--no-samples", "--logdir", str(tmp_path), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert seen[-1] == ((tmp_path,), {"steps": 24, "serve": False, "port": 8501, "samples": False, "seed": 3})


def test_dashboard_hands_its_options_on_and_refuses_a_missing_logdir(monkeypatch, tmp_path):
    import app.launch as launch

    seen = []
    monkeypatch.setattr(launch, "os", type("Os", (), {"execve": lambda *a: seen.append(a), "environ": {}}))
    result = runner.invoke(app, ["dashboard", str(tmp_path), "--port", "9001"])
    assert result.exit_code == 0, result.output
    (_cmd, argv, env) = seen[0]
    assert "9001" in argv and "127.0.0.1" in argv and env["TRUSTSCOPE_LOGDIR"] == str(tmp_path.resolve())
    result = runner.invoke(app, ["dashboard", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_validate(logdir, tmp_path):
    result = runner.invoke(app, ["validate", str(logdir)])
    assert result.exit_code == 0 and "ok: 1 run(s)" in result.output
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text("{nope")
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1 and "unreadable run manifest" in result.output
    result = runner.invoke(app, ["validate", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "is not a directory" in result.output


def test_sql(logdir):
    result = runner.invoke(app, ["sql", str(logdir), "select step, count(*) as n from tokens group by 1 order by 1",
                                 "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "\"step\",\"n\"" and len(result.output.splitlines()) == 3
    result = runner.invoke(app, ["sql", str(logdir), "explain analyze drop view tokens"])
    assert result.exit_code == 1 and "refused" in result.output
    result = runner.invoke(app, ["sql", str(logdir), "select 1", "--format", "xml"])
    assert result.exit_code == 2 and "--format 'xml'" in result.output


def test_report(logdir, tmp_path):
    result = runner.invoke(app, ["report", str(logdir), "--html", str(tmp_path / "r.html")], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "run0" in result.output and (tmp_path / "r.html").stat().st_size > 0
    result = runner.invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_the_dashboard_warms_its_cache_while_the_server_starts(logdir, tmp_path):
    """``trustscope dashboard`` opens the log once in a background process: the catalogue and every kept aggregate
    land in the cache, and a connection opened afterwards computes nothing."""
    import os

    from app.launch import warm_up
    from trustscope.db import connect

    cache = tmp_path / "cache"
    proc = warm_up(logdir, {**os.environ, "TRUSTSCOPE_CACHE": str(cache)})
    assert proc.wait(timeout=300) == 0
    assert list((cache / "queries" / "step_partials").glob("*.parquet"))
    with connect(logdir, cache_dir=cache / "queries") as db:
        assert len(db.step_summary()) > 0 and db.partials_computed == 0
