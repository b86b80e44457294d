"""Asynchronous partial rollouts: responses continued from their sampled ids across weight versions, each token
tagged with the version that sampled it, mu that version's logprob, and the staleness bound's drops."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trustscope.engines import make_engine
from trustscope.engines.base import Rollout
from trustscope.train.config import ConfigError, TrainConfig, staleness_bound
from trustscope.train.loop import train
from trustscope.train.rollouts import PartialRollouts
from trustscope.train.tasks import get_task

# ---------------------------------------------------------------------------------------------------------------
# the scheduler and the bound, on an engine whose mu names its weight version


class VersionedEngine:
    """An engine stub: every new token is id 5 with mu ``-0.1 * (version + 1)``; a response stops after
    ``length`` tokens. ``version`` is what ``update_weights`` last loaded; ``generated`` counts tokens sampled."""

    name = "stub"

    def __init__(self, length: int) -> None:
        self.length, self.version, self.generated = length, 0, 0
        self.tokenizer = self

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [[1, 2, 3] for _ in prompts]

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["7" for _ in ids]

    def sampling_info(self) -> dict:
        return {}

    def extend(self, prompt_ids, max_tokens, temperature, top_p, topk, seed) -> Rollout:
        new = [min(m, self.length - (len(ids) - 3)) for ids, m in zip(prompt_ids, max_tokens, strict=True)]
        self.generated += sum(new)
        mu = -0.1 * (self.version + 1)
        return Rollout(prompts=["p"] * len(new), n=1, topk=1, prompt_index=list(range(len(new))),
                       prompt_ids=prompt_ids, response_ids=[[5] * t for t in new], mu_logprobs=[[mu] * t for t in new],
                       mu_topk_ids=[[[5]] * t for t in new], mu_topk_logprobs=[[[mu]] * t for t in new],
                       finish_reasons=["stop" if len(ids) - 3 + t >= self.length else "length"
                                       for ids, t in zip(prompt_ids, new, strict=True)],
                       texts=["7"] * len(new))


def drive(k: int, steps: int = 8, batches: int = 3, length: int = 4) -> tuple[PartialRollouts, VersionedEngine, list]:
    """``steps`` batches of a stub run, syncing version ``step + 1`` after each as the trainer does."""
    cfg = TrainConfig(prompts_per_step=2, group_size=2, max_tokens=8, async_chunk_tokens=1, async_batches=batches,
                      max_staleness=k, topk=1, run_id="x")
    engine = VersionedEngine(length)
    sampler = PartialRollouts(engine, get_task("add1"), cfg)
    got = []
    for step in range(steps):
        got.append((step, sampler.batch(step)))
        engine.version = sampler.state.version = step + 1
    return sampler, engine, got


def worst_staleness(got: list) -> int:
    return max(step - v for step, batch in got for vs in batch.versions for v in vs)


@pytest.mark.parametrize("k", [-1, 0, 1, 2, 3])
def test_versions_mu_and_the_staleness_bound(k):
    sampler, engine, got = drive(k)
    unbounded = worst_staleness(drive(-1)[2])
    assert unbounded >= 2  # three steps' worth of groups in flight: tokens two versions old get trained
    worst, spanning, trained = 0, 0, 0
    for step, batch in got:
        assert len(batch.rollout) == 4 and all(len(v) == 4 for v in batch.versions)
        for versions, mu in zip(batch.versions, batch.rollout.mu_logprobs, strict=True):
            assert mu == pytest.approx([-0.1 * (v + 1) for v in versions])  # mu is the sampling version's
            assert versions == sorted(versions) and max(versions) <= step
            worst = max(worst, step - min(versions))
            spanning += len(set(versions)) > 1
            trained += len(versions)
        assert batch.stats["async/staleness_max"] == max(step - v for vs in batch.versions for v in vs)
    st = sampler.state
    in_flight = sum(len(r.ids) for _, _, group in st.groups for r in group)
    assert engine.generated == trained + st.dropped_tokens + in_flight  # every sampled token is accounted for
    assert got[-1][1].stats["async/dropped_groups_total"] == st.dropped_groups
    assert (spanning > 0) == (k != 0)  # responses straddle weight updates (at k = 0 none can be trained)
    if k < 0:
        assert worst == unbounded and st.dropped_groups == 0
    else:  # the bound holds; groups are dropped exactly when it is tighter than the unbounded run's staleness
        assert worst <= k and (st.dropped_groups > 0) == (k < unbounded)


def test_one_batch_in_flight_is_on_policy():
    _, _, got = drive(-1, batches=1)
    assert all(set(v) == {step} for step, batch in got for v in batch.versions)


@pytest.mark.parametrize(("changes", "field"), [
    ({"async_chunk_tokens": -1}, "async_chunk_tokens=-1"),
    ({"async_chunk_tokens": 4, "async_batches": 0}, "async_batches=0"),
    ({"async_chunk_tokens": 4, "max_staleness": -2}, "max_staleness=-2"),
    ({"max_staleness": 1}, "max_staleness=1: max_staleness bounds asynchronous partial rollouts: set async_chunk_tokens"),
    ({"async_chunk_tokens": 4, "policy_lag": 1}, "policy_lag=1: asynchronous partial rollouts"),
    ({"async_chunk_tokens": 4, "sync_every": 3, "max_staleness": 1}, "max_staleness=1: the engine lags the trainer "
                                                                       "by up to sync_every - 1 = 2"),
])
def test_bad_async_settings_are_refused(changes, field):
    with pytest.raises(ConfigError, match="^" + field.replace("(", r"\(")):
        TrainConfig(run_id="x", **changes)


def test_declared_bound():
    assert staleness_bound(TrainConfig(run_id="x", async_chunk_tokens=2, max_staleness=3)) == 3
    assert staleness_bound(TrainConfig(run_id="x", async_chunk_tokens=2)) is None
    assert staleness_bound(TrainConfig(run_id="x", policy_lag=2, sync_every=2)) == 3


# ---------------------------------------------------------------------------------------------------------------
# real engines: a response continued across a weight update


def perturbed(model_dir: str, scale: float) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int]) -> np.ndarray:
    """log pi(response[t] | prompt, response[:t]) under ``model``, one sequence, no padding."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_a_response_continued_across_a_weight_update(engine_name, toy_model_dir):
    """Two tokens under version 0, a sync, two more from the sampled ids under version 1: mu of each token is the
    teacher-forced logprob under the weights of its own version (fp32), not the other's."""
    from transformers import AutoModelForCausalLM

    v0 = AutoModelForCausalLM.from_pretrained(str(toy_model_dir), dtype=torch.float32)
    v1 = perturbed(str(toy_model_dir), 0.02)
    engine = make_engine(engine_name, str(toy_model_dir), dtype="float32", seed=0)
    try:
        prompts = engine.encode([p.prompt for p in get_task("add1").split("eval")[:6]])
        first = engine.extend(prompts, [2] * len(prompts), topk=5, seed=1)
        engine.update_weights(v1)
        live = [i for i, f in enumerate(first.finish_reasons) if f == "length"]
        assert live, "every response stopped within its first chunk"
        second = engine.extend([prompts[i] + first.response_ids[i] for i in live], [2] * len(live), topk=5, seed=2)
    finally:
        engine.close()
    gaps_own, gaps_other = [], []
    for j, i in enumerate(live):
        response = first.response_ids[i] + second.response_ids[j]
        mu = np.array(first.mu_logprobs[i] + second.mu_logprobs[j])
        version = np.array([0] * len(first.response_ids[i]) + [1] * len(second.response_ids[j]))
        under = {0: teacher_forced(v0, prompts[i], response), 1: teacher_forced(v1, prompts[i], response)}
        own = np.where(version == 0, under[0], under[1])
        other = np.where(version == 0, under[1], under[0])
        gaps_own += list(np.abs(mu - own))
        gaps_other += list(np.abs(mu - other))
    print(f"\n{engine_name}: max |mu - own version| {max(gaps_own):.2e}, mean |mu - other| {np.mean(gaps_other):.2e}")
    assert max(gaps_own) < 1e-4
    assert np.mean(gaps_other) > 1e-2


@pytest.mark.slow
def test_async_training_logs_per_token_versions(tmp_path):
    """A short asynchronous run (transformers engine): per-token policy_version, spanning responses, the bound held
    and declared, staleness readable in the views; the manifest records the bound for doctor."""
    from trustscope.query.connection import connect

    seen = {}
    cfg = TrainConfig(engine="hf", async_chunk_tokens=1, async_batches=3, max_staleness=1, steps=4,
                      prompts_per_step=4, group_size=4, max_tokens=6, topk=5, lr=1e-2, eval_every=0, threads=1,
                      logdir=str(tmp_path), run_id="async")
    train(cfg, on_step=lambda step, s: seen.update({step: s}))
    run = tmp_path / "async"
    assert json.loads((run / "run.json").read_text())["max_staleness"] == 1
    tokens = pq.read_table([str(f) for f in sorted((run / "tokens").rglob("*.parquet"))]).to_pandas()
    assert tokens["policy_version"].notna().all() and (tokens["policy_version"] <= tokens["step"]).all()
    spans = tokens.groupby(["step", "sample_id"])["policy_version"].nunique()
    assert (spans > 1).any()  # a response started under one version and finished under the next
    db = connect(str(run), cache=False)
    by = dict(db.con.execute("select staleness, count(*) from tokens group by 1").fetchall())
    assert set(by) <= {0, 1} and by.get(1, 0) > 0
    assert sum(by.values()) == len(tokens)
    assert all(seen[s]["async/staleness_max"] <= 1 for s in seen)
    assert sum(seen[s]["async/dropped_groups"] for s in seen) == seen[3]["async/dropped_groups_total"]


@pytest.mark.slow
def test_async_resume_continues_the_groups_in_flight(tmp_path):
    """A checkpoint holds the groups in flight and the engine's version: resumed, the run's later steps are the
    uninterrupted run's (same rewards, staleness and gradient norms)."""
    base = dict(engine="hf", async_chunk_tokens=1, async_batches=3, max_staleness=2, prompts_per_step=4,
                group_size=4, max_tokens=6, topk=5, lr=1e-3, eval_every=0, threads=1, save_every=1,
                logdir=str(tmp_path))
    full, resumed = {}, {}
    train(TrainConfig(**base, steps=4, run_id="full"), on_step=lambda step, s: full.update({step: s}))
    train(TrainConfig(**base, steps=2, run_id="cut"))
    train(TrainConfig(**base, steps=4, run_id="cut", resume=True), on_step=lambda step, s: resumed.update({step: s}))
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        for name in ("reward/mean", "async/staleness_mean", "async/spanning_frac", "grad_norm"):
            assert resumed[step][name] == pytest.approx(full[step][name], rel=1e-6), (step, name)


@pytest.mark.slow
def test_two_ranks_log_the_versions_of_one(tmp_path):
    """Data-parallel (torchrun, 2 ranks): rank 0 samples the partial rollouts and each rank logs its share's
    per-token versions; together they are the one-rank run's, token for token, and the losses agree."""
    import os
    import socket
    import subprocess
    import sys

    options = {"engine": "hf", "async_chunk_tokens": 1, "async_batches": 2, "max_staleness": 1, "prompts_per_step": 4,
               "group_size": 4, "max_tokens": 6, "topk": 5, "steps": 3, "eval_every": 0, "threads": 1, "lr": 1e-3}
    train(TrainConfig(logdir=str(tmp_path / "one"), run_id="dp", **options))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "trustscope.cli", "train", "--logdir", str(tmp_path / "two"),
           "--run-id", "dp", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    key = ["step", "sample_id", "pos"]
    cols = [*key, "token_id", "policy_version"]
    one, two = (pq.read_table(tmp_path / name / "dp" / "tokens").to_pandas().sort_values(key).reset_index(drop=True)
                for name in ("one", "two"))
    assert sorted(two["rank"].unique()) == [0, 1]
    assert (two[cols].values == one[cols].values).all()
    assert (one.groupby(["step", "sample_id"])["policy_version"].nunique() > 1).any()
    steps = {name: pq.read_table(tmp_path / name / "dp" / "steps").to_pandas() for name in ("one", "two")}
    losses = {name: df[df["name"] == "loss"].sort_values("step")["value"].to_numpy() for name, df in steps.items()}
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5, atol=1e-6)
