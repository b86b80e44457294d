"""The integrated trainer end to end on the toy world: vLLM rollouts on CPU, logs that validate, resume, knobs."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.runformat.validation import validate_run
from trustscope.train.checkpoints import latest_checkpoint
from trustscope.train.config import TrainConfig
from trustscope.train.loop import group_advantages, lr_lambda, train

SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "6", "--topk", "5", "--mini-batches", "2",
         "--eval-every", "2", "--eval-problems", "16", "--threads", "1", "--lr", "1e-3"]


def read(run_dir, table):
    return pq.read_table(run_dir / table).to_pandas()


# ---------------------------------------------------------------------------------------------------------------
# pure pieces


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4, std_normalize=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    adv = group_advantages(rewards, 4, std_normalize=True)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    assert torch.allclose(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))


def test_lr_schedules():
    f = lr_lambda(TrainConfig(steps=10, warmup_steps=1, lr_schedule="cosine", run_id="x"))
    assert f(0) == pytest.approx(0.5)
    assert f(1) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.0, abs=1e-12)
    assert f(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 9)))
    g = lr_lambda(TrainConfig(steps=10, lr_schedule="linear", run_id="x"))
    assert [g(0), g(5)] == [pytest.approx(1.0), pytest.approx(0.5)]


# ---------------------------------------------------------------------------------------------------------------
# end to end with vLLM


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """A 3-step DPPO top-K TV run through ``trustscope train`` (vLLM, bf16 rollouts), checkpointing every step."""
    logdir = tmp_path_factory.mktemp("runs")
    args = ["train", "--loss", "dppo_topk_tv", "--engine", "vllm", "--engine-dtype", "bfloat16", "--steps", "3",
            "--save-every", "1", "--logdir", str(logdir), "--run-id", "e2e", *SMALL]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return logdir / "e2e"


@pytest.mark.slow
def test_three_steps_log_everything_and_validate(vllm_run):
    assert validate_run(vllm_run) == []
    result = CliRunner().invoke(app, ["validate", str(vllm_run)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((vllm_run / "run.json").read_text())
    assert manifest["status"] == "finished"
    assert manifest["config"]["loss"] == "dppo_topk_tv" and manifest["config"]["engine_dtype"] == "bfloat16"
    steps = read(vllm_run, "steps")
    rewards = steps[steps.name == "reward/mean"].sort_values("step")
    assert rewards.step.tolist() == [0, 1, 2]
    assert rewards.value.between(0, 1).all()
    assert sorted(steps[steps.name == "eval/reward"].step) == [1, 2]
    for name in ("loss", "grad_norm", "policy/blocked_frac", "policy/mismatch_abs_mean", "throughput/tokens_per_s"):
        assert steps[steps.name == name].value.map(math.isfinite).all(), name
    samples = read(vllm_run, "samples")
    assert len(samples) == 3 * 16
    tokens = read(vllm_run, "tokens")
    assert len(tokens) == samples.length.sum()
    assert tokens.mu_topk_ids.map(len).eq(5).all() and tokens.pi_topk_logprobs.notna().all()
    assert tokens.topk_tv.between(0, 1).all() and tokens.entropy.gt(0).all()
    assert tokens.old_logprob.isna().all()  # no pi_old recompute: the rule anchors on mu
    assert (tokens.pi_logprob != tokens.mu_logprob).mean() > 0.5  # bf16 rollouts vs the fp32 trainer


@pytest.mark.slow
def test_logged_mask_is_the_rules_mask_on_the_logged_values(vllm_run):
    """Re-running the rule on the logged mu, pi, top-K lists and advantages gives back the logged ``kept``."""
    from trustscope.losses import PolicyBatch, get_loss

    tokens = read(vllm_run, "tokens")
    col = lambda name: torch.tensor(tokens[name].to_numpy())[None]  # noqa: E731  (1, N)
    lists = lambda name: torch.tensor(np.stack(tokens[name].to_numpy()))[None]  # noqa: E731  (1, N, K)
    batch = PolicyBatch(pi_logprob=col("pi_logprob"), mu_logprob=col("mu_logprob"), advantages=col("advantage"),
                        mask=torch.ones(1, len(tokens), dtype=torch.bool),
                        mu_topk_logprobs=lists("mu_topk_logprobs"), pi_topk_logprobs=lists("pi_topk_logprobs"))
    keep = get_loss("dppo_topk_tv")(batch).keep[0].numpy()
    assert (keep == tokens.kept.to_numpy()).all()
    assert not tokens.kept.all()  # lr 1e-3 with two mini-batches: the trust region does block some tokens


@pytest.mark.slow
def test_every_trainable_parameter_changes(vllm_run):
    from transformers import AutoModelForCausalLM

    from trustscope.train.toy import build_toy_model

    before = AutoModelForCausalLM.from_pretrained(build_toy_model()).state_dict()
    after = AutoModelForCausalLM.from_pretrained(latest_checkpoint(vllm_run)).state_dict()
    assert before.keys() == after.keys()
    # k_proj's bias adds the same q.b to every key's score, so softmax cancels it: its gradient is zero.
    unchanged = [k for k in before if not k.endswith("k_proj.bias") and torch.equal(before[k], after[k])]
    assert unchanged == []


@pytest.mark.slow
def test_resume_continues_the_same_run_and_log(vllm_run, tmp_path):
    args = ["train", "--loss", "dppo_topk_tv", "--engine", "vllm", "--engine-dtype", "bfloat16", "--steps", "5",
            "--save-every", "1", "--logdir", str(vllm_run.parent), "--run-id", "e2e", "--resume", *SMALL]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert validate_run(vllm_run) == []
    steps = read(vllm_run, "steps")
    assert sorted(steps[steps.name == "reward/mean"].step) == [0, 1, 2, 3, 4]
    assert read(vllm_run, "samples").groupby("step").size().tolist() == [16] * 5
    assert latest_checkpoint(vllm_run).name == "step_000004"
    assert json.loads((vllm_run / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_resume_after_a_crash_drops_the_steps_after_the_checkpoint(tmp_path):
    """A run that dies after logging step 2 with its last checkpoint at step 1 resumes at step 2, logging it once."""
    small = dict(engine="hf", prompts_per_step=4, group_size=4, max_tokens=6, eval_every=0, save_every=2,
                 logdir=str(tmp_path), run_id="crash")

    def die(step, scalars):
        if step == 2:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(TrainConfig(steps=4, **small), on_step=die)
    run = tmp_path / "crash"
    assert json.loads((run / "run.json").read_text())["status"] == "crashed"
    assert sorted(read(run, "steps").query("name == 'loss'").step) == [0, 1, 2]
    train(TrainConfig(steps=4, resume=True, **small))
    assert validate_run(run) == []
    assert sorted(read(run, "steps").query("name == 'loss'").step) == [0, 1, 2, 3]
    assert read(run, "samples").groupby("step").size().tolist() == [16] * 4
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_a_run_killed_mid_training_resumes_with_each_step_once(tmp_path):
    """``trustscope train`` SIGKILLed once step 2 is logged (its last checkpoint at step 1), then ``--resume``: every
    step holds as many rows as in an uninterrupted run, and each response's tokens once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from trustscope import runformat as S

    args = ["--engine", "hf", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "6", "--eval-every",
            "0", "--save-every", "2", "--steps", "4", "--threads", "1"]

    def command(logdir, *more):
        return [sys.executable, "-m", "trustscope.cli", "train", *args, "--logdir", str(logdir), "--run-id", "k",
                *more]

    proc = subprocess.Popen(command(tmp_path / "a"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest, deadline = tmp_path / "a" / "k" / S.MANIFEST, time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if (json.loads(manifest.read_text()).get("last_step") or -1) >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read()[-2000:]
    subprocess.run(command(tmp_path / "a", "--resume"), check=True, capture_output=True, env=os.environ)
    subprocess.run(command(tmp_path / "b"), check=True, capture_output=True, env=os.environ)

    def per_step(run):
        return {t: read(run, t).groupby("step").size().to_dict() for t in ("samples", "steps")}

    got = per_step(tmp_path / "a" / "k")
    assert got == per_step(tmp_path / "b" / "k") and sorted(got["samples"]) == [0, 1, 2, 3]
    tokens, samples = read(tmp_path / "a" / "k", "tokens"), read(tmp_path / "a" / "k", "samples")
    assert tokens.groupby("step").size().to_dict() == samples.groupby("step")["length"].sum().to_dict()
    assert validate_run(tmp_path / "a" / "k") == []


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    cfg = TrainConfig(run_id="none", resume=True, logdir=str(tmp_path), engine="hf")
    with pytest.raises(FileNotFoundError, match="holds no checkpoint; set save_every > 0"):
        train(cfg)


@pytest.mark.slow
def test_an_existing_run_is_not_overwritten(vllm_run):
    result = CliRunner().invoke(app, ["train", "--logdir", str(vllm_run.parent), "--run-id", "e2e"])
    assert result.exit_code == 2
    assert "already exists" in result.output and "set resume=true" in result.output


# ---------------------------------------------------------------------------------------------------------------
# mismatch knobs and bad input


@pytest.mark.slow
def test_stale_rollouts_lag_the_policy(tmp_path):
    """policy_lag=1, sync_every=2 with an fp32 HF engine: mu equals pi_old exactly when, and only when, in sync."""
    seen = {}
    cfg = TrainConfig(engine="hf", policy_lag=1, sync_every=2, recompute_old=True, loss="minirl", steps=4,
                      prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2, eval_every=0, log_tokens=False,
                      logdir=str(tmp_path), run_id="lag")
    train(cfg, on_step=lambda step, s: seen.update({step: s}))
    assert [seen[s]["policy_lag"] for s in range(4)] == [0, 1, 2, 1]
    assert seen[0]["mismatch/old_abs_mean"] < 1e-4
    assert all(seen[s]["mismatch/old_abs_mean"] > 1e-3 for s in (1, 2, 3))


def test_bad_option_exits_with_what_to_set(tmp_path):
    result = CliRunner().invoke(app, ["train", "--loss", "minirl", "--logdir", str(tmp_path)])
    assert result.exit_code == 2
    assert "set recompute_old=true" in result.output
    result = CliRunner().invoke(app, ["train", "--lr", "fast"])
    assert result.exit_code == 2 and "lr='fast': expected a number" in result.output
    assert not list(tmp_path.iterdir())


def test_list_options_shows_every_field():
    result = CliRunner().invoke(app, ["train", "--list-options"], terminal_width=200)
    assert result.exit_code == 0
    assert "--policy-lag" in result.output and "--engine-dtype" in result.output


@pytest.mark.slow
def test_demo_without_serving(tmp_path, monkeypatch):
    """The command end to end, two steps, on toy-v2 (it ships built: the demo's own world is a 4-7 minute warm
    start on an empty cache, trained by tests/test_demo.py's heavy test)."""
    from trustscope import demo

    monkeypatch.setitem(demo.DEMO_SETTING, "model", "toy-v2")
    result = CliRunner().invoke(app, ["demo", "--no-serve", "--steps", "2", "--logdir", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]  # beside the shipped runs' links
    assert validate_run(run) == []
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["config"]["loss"] == "dppo_binary_tv" and manifest["config"]["model"] == "toy-v2"
    assert re.search(r"blocked \d+\.\d+%\s\(\d[\d,]*\sof\s\d[\d,]*\stokens\)", result.output), result.output
    assert manifest["model"]["path"].startswith("toy/addcol2-") and not manifest["sampling"]["model_dir"].startswith("/")
    assert "What to look at first:" in result.output and "  - Runs: " in result.output


def test_the_progress_line_counts_the_blocked_tokens_of_the_whole_step():
    """The rule's counts are per-update means: the step's line multiplies them by its updates (token updates when
    each token is updated once an epoch, several times a step); a rule without counts adds nothing."""
    from trustscope.train.loop import blocked_count

    s = {"policy/n_blocked": 3.5, "policy/n_grad_tokens": 1220.25, "updates": 8}
    assert blocked_count(s) == " (28 of 9,762 tokens)"
    assert blocked_count(s, epochs=2) == " (28 of 9,762 token updates)"
    assert blocked_count({"updates": 4}) == ""
