"""trustscope.trackers: the step summaries as tracker metrics, against hand-computed rows, against the query
layer's own per-step figures, and written to the real trackers offline and read back with each one's own reader."""

from __future__ import annotations

import glob
import json
import math
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trustscope.db import Overview, connect
from trustscope.early_warning import WarningLines, collapse_warnings
from trustscope.logger import TokenLogger
from trustscope.query.analyses import OVERVIEW_COLUMNS
from trustscope.trackers import (
    EarlyWarning,
    LiveTrackerAlerts,
    RunReporting,
    StepReporter,
    Trackers,
    TrackerWarning,
    committed_step_rows,
    open_trackers,
    parse_report_to,
    step_metrics,
)

P = "trustscope"


def test_step_metrics_by_hand():
    rows = [
        {"metric": "tokens", "advantage_sign": "positive", "mu_low": 0.1, "count": 6},
        {"metric": "tokens", "advantage_sign": "positive", "mu_low": 0.5, "count": 4},  # another bucket
        {"metric": "tokens", "advantage_sign": "negative", "mu_low": 0.1, "count": 5},
        {"metric": "tokens", "advantage_sign": "zero", "mu_low": 0.1, "count": 5},
        {"metric": "blocked", "rule": "ppo_clip", "advantage_sign": "positive", "mu_low": 0.1, "count": 2},
        {"metric": "blocked", "rule": "ppo_clip", "advantage_sign": "negative", "mu_low": 0.1, "count": 1},
        {"metric": "blocked", "rule": "icepop", "advantage_sign": "negative", "mu_low": 0.1, "count": 0},
        {"metric": "trainer_blocked", "advantage_sign": "negative", "mu_low": 0.1, "count": 3},
        {"metric": "trainer_blocked", "advantage_sign": "zero", "mu_low": 0.1, "count": 5},  # A = 0: not counted
        {"metric": "bad_negative", "advantage_sign": "negative", "count": 2, "threshold": 0.5},
        # two ranks' moments of |pi - mu|: values {0.1, 0.3} and {0.2}
        {"metric": "abs_prob_diff", "count": 2, "sum": 0.4, "sum_sq": 0.1, "min": 0.1, "max": 0.3},
        {"metric": "abs_prob_diff", "count": 1, "sum": 0.2, "sum_sq": 0.04, "min": 0.2, "max": 0.2},
        {"metric": "abs_prob_diff_hist", "bin_low": 0.1, "bin_high": 0.2, "count": 1},
        {"metric": "abs_prob_diff_hist", "bin_low": 0.2, "bin_high": 0.3, "count": 1},
        {"metric": "abs_prob_diff_hist", "bin_low": 0.3, "bin_high": 0.4, "count": 1},
        # a summary this module has never heard of: moments and a new column flow through under its own name
        {"metric": "ess", "count": 4, "sum": 2.0, "sum_sq": 1.0, "min": 0.5, "max": 0.5, "horizon": 8},
    ]
    m = step_metrics(rows, step=7)
    assert m[f"{P}/step"] == 7
    assert m[f"{P}/tokens/total"] == 20 and m[f"{P}/tokens/positive"] == 10 and m[f"{P}/tokens/zero"] == 5
    assert m[f"{P}/blocked_count/ppo_clip"] == 3 and m[f"{P}/blocked_frac/ppo_clip"] == 3 / 15  # over A != 0
    assert m[f"{P}/blocked_count/icepop"] == 0 and m[f"{P}/blocked_frac/icepop"] == 0
    assert m[f"{P}/trainer_blocked_count"] == 3 and m[f"{P}/trainer_blocked_rate"] == 3 / 15
    assert m[f"{P}/bad_negative_count"] == 2 and m[f"{P}/bad_negative_rate"] == 2 / 20  # over every token
    assert m[f"{P}/bad_negative/threshold"] == 0.5
    assert m[f"{P}/mismatch/abs_mean"] == pytest.approx(0.2)
    assert m[f"{P}/mismatch/abs_std"] == pytest.approx(np.std([0.1, 0.3, 0.2]))
    assert m[f"{P}/mismatch/abs_min"] == 0.1 and m[f"{P}/mismatch/abs_max"] == 0.3
    assert m[f"{P}/mismatch/abs_p50"] == 0.3 and m[f"{P}/mismatch/abs_p90"] == 0.4  # the bins' upper edges
    assert m[f"{P}/ess/mean"] == 0.5 and m[f"{P}/ess/std"] == 0 and m[f"{P}/ess/horizon"] == 8
    assert step_metrics([]) == {}
    # rules seen at other steps read 0 where they have no rows
    zero = step_metrics(rows, 7, rules={"blocked": ["ppo_clip", "gspo"], "other_blocked": ["gspo"]})
    assert zero[f"{P}/blocked_count/gspo"] == 0 and zero[f"{P}/blocked_frac/gspo"] == 0
    assert zero[f"{P}/other_blocked_count/gspo"] == 0 and zero[f"{P}/blocked_count/ppo_clip"] == 3
    with pytest.raises(ValueError, match="metric=None"):
        step_metrics([{"count": 1}])


def _tokens(rng, b: int = 6, t: int = 12) -> dict:
    mu = np.log(rng.uniform(0.02, 1.0, (b, t)))
    pi = np.minimum(mu + rng.normal(0.0, 0.4, (b, t)), 0.0)
    return {"token_id": rng.integers(0, 40, (b, t)), "mu_logprob": mu, "pi_logprob": pi,
            "advantage": rng.normal(size=b), "prompt_id": np.arange(b) // 2,
            "kept": rng.uniform(size=(b, t)) > 0.2}


def test_latest_step_in_memory_equals_the_committed_summaries_and_the_query_layer(tmp_path):
    """Two calls a step: what the logger hands an integration without reading a file is what lands on disk, and
    its fractions are the dashboard's (summary_steps, summary_blocked)."""
    rng = np.random.default_rng(3)
    mask = np.ones((6, 12), bool)
    seen = {}
    with TokenLogger(tmp_path, "r", flush_seconds=60) as logger:
        reporter = StepReporter(logger, wait_s=60.0, warning=False)
        for step in range(3):
            logger.log_step(step, tokens=_tokens(rng), mask=mask)
            logger.log_step(step, tokens=_tokens(rng), mask=mask)
            seen[step] = reporter.metrics()
            assert seen[step][f"{P}/step"] == step and seen[step][f"{P}/tokens/total"] == 144
        assert reporter.metrics() == {}  # each step once
        logger.flush()  # a flush between two calls of a step: the step's rows are the two sets together
        logger.log_step(3, tokens=_tokens(rng), mask=mask)
        logger.flush()
        logger.log_step(3, tokens=_tokens(rng), mask=mask)
        seen[3] = reporter.metrics()
    for step, metrics in seen.items():
        assert metrics == pytest.approx(step_metrics(committed_step_rows(tmp_path / "r", step), step), rel=1e-12)
    with connect(tmp_path) as db:
        overview = db.overview()
    steps = overview.steps.set_index("step")
    blocked = overview.blocked[overview.blocked["advantage_side"] == "all"]
    for step, m in seen.items():
        assert m[f"{P}/tokens/total"] == steps.loc[step, "n_tokens"]
        assert m[f"{P}/mismatch/abs_mean"] == pytest.approx(steps.loc[step, "mismatch_mean"])
        assert m[f"{P}/bad_negative_rate"] == pytest.approx(steps.loc[step, "bad_negative_rate"])
        assert m[f"{P}/trainer_blocked_rate"] == pytest.approx(steps.loc[step, "trainer_blocked_frac"])
        for row in blocked[blocked["step"] == step].itertuples():
            assert m[f"{P}/blocked_frac/{row.rule}"] == pytest.approx(row.blocked_frac), row.rule
            assert m[f"{P}/blocked_count/{row.rule}"] == row.n_blocked


def test_without_waiting_the_reporter_gives_the_newest_whole_step(tmp_path):
    rng = np.random.default_rng(0)
    with TokenLogger(tmp_path, "r") as logger:
        assert logger.step_summaries() is None
        logger.log_step(0, tokens=_tokens(rng), mask=np.ones((6, 12), bool))
        assert logger.step_summaries(wait_s=60)[0] == 0
        logger.log_step(1, tokens=_tokens(rng), mask=np.ones((6, 12), bool))
        got = logger.step_summaries()  # at once: step 0 (whole), or step 1 once the thread has summarised it
        assert got is not None and got[0] in (0, 1)
        with pytest.raises(ValueError, match="wait_s must be"):
            logger.step_summaries(wait_s=-1)


def test_early_warning_equals_collapse_warnings_over_the_whole_run():
    """Step by step, with only the baseline and the recent window kept, the warning reads as the report's over
    every step of the run."""
    rng = np.random.default_rng(5)
    lines = WarningLines(bad_rate=0.02, mismatch_growth=1.5, window=4)
    warning, got, rows = EarlyWarning(lines), [], []
    for step in range(20):
        n = 200.0
        bad = float(rng.integers(0, 3 + step // 2))
        mismatch = 0.01 * (1 + step / 8) + rng.uniform(0, 0.002)
        metrics = {f"{P}/step": float(step), f"{P}/tokens/total": n, f"{P}/bad_negative_count": bad,
                   f"{P}/bad_negative_rate": bad / n, f"{P}/mismatch/abs_mean": mismatch}
        got.append(warning.update(metrics))
        rows.append({"run_id": "run", "step": step, "n_tokens": n, "n_bad_negative": bad, "mismatch_mean": mismatch})
    steps = pd.DataFrame(rows).reindex(columns=list(OVERVIEW_COLUMNS))
    want = collapse_warnings(Overview(steps, pd.DataFrame(), pd.DataFrame()), ["run"], lines)
    assert [g[f"{P}/warning"] for g in got] == want["warning"].astype(float).tolist()
    assert [g[f"{P}/warning/bad_rate_recent"] for g in got] == pytest.approx(want["bad_rate_recent"].tolist())
    # past the first window (whose baseline live is the steps so far, and which never warns) the same growth
    w = lines.window
    assert [g[f"{P}/warning/mismatch_growth"] for g in got][w:] == pytest.approx(want["mismatch_growth"][w:].tolist())
    assert 0 < want["warning"].sum() < 20 and warning.fired_at == int(want[want["warning"]]["step"].iloc[0])
    assert "|pi - mu|" in warning.reason(got[-1]) or "bad negative" in warning.reason(got[-1])


# ------------------------------------------------------------------------------------------ the real trackers


METRICS = [{f"{P}/step": float(s), f"{P}/blocked_frac/ppo_clip": 0.1 * s, f"{P}/mismatch/abs_mean": 0.01 + s,
            "reward/mean": 0.5 * s} for s in range(3)]


def read_wandb_history(run_dir: Path) -> list[dict]:
    """The history records of a W&B offline run's ``.wandb`` file: W&B's record log (32 KiB blocks, each record
    with a 7-byte header: CRC, length, kind; a record may span blocks), each record a ``wandb_internal_pb2``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, record, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7: pos + 7 + n], pos + 7 + n
        record = chunk if kind in (1, 2) else record + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(record)
            if r.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            elif r.WhichOneof("record_type") == "alert":
                out.append({"alert": r.alert.title, "text": r.alert.text})
    return out


@pytest.mark.slow
def test_wandb_tensorboard_mlflow_read_back_with_their_own_readers(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackerWarning)  # every one opens
        trackers = Trackers(open_trackers(["wandb", "tensorboard", "mlflow"], tmp_path, "run-1", {"loss": "x"}))
    assert [t.name for t in trackers.trackers] == ["wandb", "tensorboard", "mlflow"]
    for s, metrics in enumerate(METRICS):
        trackers.log(metrics, step=s + 10)  # the trainer's step; the summaries' is trustscope/step
    trackers.alert("collapse warning: run-1", "bad negative updates")
    LiveTrackerAlerts(["wandb", "tensorboard"]).alert("live run", "as TRL's report_to run gets it")
    trackers.close()

    history = read_wandb_history(tmp_path)
    assert {"alert": "live run", "text": "as TRL's report_to run gets it"} in history
    logged = [h for h in history if "alert" not in h]
    assert [h[f"{P}/blocked_frac/ppo_clip"] for h in logged] == pytest.approx([0.0, 0.1, 0.2])
    assert [h["_step"] for h in logged] == [10, 11, 12] and [h[f"{P}/step"] for h in logged] == [0, 1, 2]
    assert {"alert": "collapse warning: run-1", "text": "bad negative updates"} in history

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars(f"{P}/blocked_frac/ppo_clip")
    assert [e.step for e in events] == [0, 1, 2] and [e.value for e in events] == pytest.approx([0.0, 0.1, 0.2])
    assert [e.step for e in acc.Scalars("reward/mean")] == [10, 11, 12]

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("trustscope").experiment_id])
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED" and run.data.params == {"loss": "x"}
    points = client.get_metric_history(run.info.run_id, f"{P}/mismatch/abs_mean")
    points = sorted((p.step, p.value) for p in points)
    assert [p[0] for p in points] == [0, 1, 2] and [p[1] for p in points] == pytest.approx([0.01, 1.01, 2.01])


TRACKIO_SCRIPT = """
import json, sys
from trustscope.trackers import Trackers, open_trackers
from trackio.sqlite_storage import SQLiteStorage
metrics = json.loads(sys.argv[1])
trackers = Trackers(open_trackers(["trackio"], ".", "run-1", {"loss": "x"}))
assert [t.name for t in trackers.trackers] == ["trackio"]
for s, m in enumerate(metrics):
    trackers.log(m, step=s + 10)
trackers.alert("collapse warning: run-1", "bad negative updates")
trackers.close()
logs = SQLiteStorage.get_logs("trustscope", "run-1")
alerts = SQLiteStorage.get_alerts("trustscope", run_name="run-1")
print("RESULT", json.dumps({"logs": [{k: v for k, v in r.items() if k != "timestamp"} for r in logs],
                  "alerts": [a.get("title") for a in alerts]}, default=str))
"""


@pytest.mark.slow
def test_trackio_local_store_read_back(tmp_path):
    """In a process of its own: trackio reads its store's folder (``TRACKIO_DIR``) once, at import."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("TRACKIO_", "HF_TOKEN"))}
    env.update(TRACKIO_DIR=str(tmp_path / "store"), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    done = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, json.dumps(METRICS)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert [r["step"] for r in out["logs"]] == [10, 11, 12]
    assert [r[f"{P}/blocked_frac/ppo_clip"] for r in out["logs"]] == pytest.approx([0.0, 0.1, 0.2])
    assert [r[f"{P}/step"] for r in out["logs"]] == [0, 1, 2]
    assert out["alerts"] == ["collapse warning: run-1"]
    assert (tmp_path / "store").is_dir()


def test_a_missing_tracker_names_the_extra_and_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.warns(TrackerWarning, match=r"'mlflow' package is not installed.*trustscope\[trackers\]"):
        opened = open_trackers(["mlflow", "wandb"], tmp_path, "r")
    assert opened == []


def test_a_tracker_that_fails_later_is_dropped_and_training_goes_on():
    class Broken:
        name = "broken"

        def log(self, metrics, step):
            raise OSError("disk full")

        def close(self):
            pass

    trackers = Trackers([Broken()])
    with pytest.warns(TrackerWarning, match="'broken' failed.*disk full"):
        trackers.log({"a": 1.0}, 0)
    assert trackers.trackers == []
    trackers.log({"a": 1.0}, 1)  # nothing left, nothing raised


def test_live_tracker_alerts_take_what_frameworks_name():
    assert LiveTrackerAlerts("wandb").names == {"wandb"} and LiveTrackerAlerts("all").names == {"wandb", "trackio"}
    assert LiveTrackerAlerts(["console", "trackio"]).names == {"trackio"} and not LiveTrackerAlerts([]).names
    LiveTrackerAlerts(["wandb", "trackio"]).alert("no run open", "nothing happens")  # and nothing raises


def test_report_to_names_are_checked():
    assert parse_report_to("wandb, tensorboard,wandb") == ("wandb", "tensorboard")
    assert parse_report_to("") == () and parse_report_to("none") == () and parse_report_to(None) == ()
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) \['neptune'\]"):
        parse_report_to("neptune")


@pytest.mark.slow
def test_trainer_report_to_tensorboard(tmp_path, toy_model_dir):
    """``--report-to``: the integrated trainer's scalars and the summaries reach TensorBoard, one step each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trustscope.train.config import ConfigError, TrainConfig
    from trustscope.train.loop import train

    with pytest.raises(ConfigError, match=r"report_to='comet'.*unknown tracker"):
        TrainConfig(report_to="comet", run_id="x")
    with pytest.raises(ConfigError, match=r"webhook='hooks.slack.com/x'.*http"):
        TrainConfig(webhook="hooks.slack.com/x", run_id="x")
    cfg = TrainConfig(engine="hf", prompts_per_step=2, group_size=4, max_tokens=6, eval_every=0, steps=3,
                      logdir=str(tmp_path), run_id="tb", report_to="tensorboard", threads=1)
    train(cfg)
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # (a rule's blocked_frac appears from the first step it blocks a token: the toy's first steps may block none)
    assert {f"{P}/tokens/total", f"{P}/mismatch/abs_mean", f"{P}/bad_negative_rate", f"{P}/warning",
            "reward/mean"} <= set(tags), tags
    reported = [e.step for e in acc.Scalars(f"{P}/tokens/total")]
    assert reported[-1] == 2 and reported == sorted(set(reported))  # each step once, the last at close
    with connect(tmp_path) as db:
        steps = db.overview().steps.set_index("step").loc[reported]
    assert [e.value for e in acc.Scalars(f"{P}/tokens/total")] == steps["n_tokens"].tolist()
    assert [e.value for e in acc.Scalars(f"{P}/mismatch/abs_mean")] == pytest.approx(
        steps["mismatch_mean"].tolist(), rel=1e-6)
    assert not math.isnan(acc.Scalars("reward/mean")[0].value)


def test_the_trainers_reporting_takes_the_warning_lines(tmp_path):
    """``RunReporting(..., lines=...)`` (the trainer's ``warn_relative``) hands its lines to the live warning,
    which then scores the relative detector; without them, the default lines and detector."""
    from trustscope import early_warning
    from trustscope.train.config import ConfigError, TrainConfig

    relative = RunReporting(None, [], None, tmp_path, "r", lines=WarningLines(relative_z=6))
    assert relative.reporter.warning.lines.relative_z == 6
    assert relative.reporter.warning.detector is early_warning.RELATIVE_DETECTOR
    plain = RunReporting(None, [], None, tmp_path, "r")
    assert plain.reporter.warning.detector is early_warning.DETECTOR and plain.reporter.warning.lines == WarningLines()
    assert TrainConfig(run_id="x", warn_relative="6").warn_relative == 6.0
    with pytest.raises(ConfigError, match="warn_relative=-1"):
        TrainConfig(run_id="x", warn_relative=-1)
