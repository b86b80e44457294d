"""Where a step's rollouts come from: the engine's samples of a step (:func:`sample_batch`), sampled ahead under a
policy lag (:func:`rollout_stream`), or continued across weight updates as asynchronous partial rollouts
(:class:`PartialRollouts`). Each yields :class:`StepRollouts`, what :func:`trustscope.train.loop.train` trains on.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.rollouts")

from trustscope.engines import Rollout
from trustscope.train.config import TrainConfig
from trustscope.train.multiturn import tool_rollout
from trustscope.train.tasks import Problem, Task


@dataclass
class StepRollouts:
    """One step's rollouts: the problems (one per group), the engine's samples and their rewards."""

    weights_step: int  # the trainer step whose weights the engine sampled with (older when lagging)
    problems: list[Problem]  # (prompts_per_step,), or this rank's share of them
    rollout: Rollout  # B = len(problems) * group_size samples, grouped by problem
    rewards: torch.Tensor  # (B,) float32
    first_group: int = 0  # the step-wide index of problems[0]: its samples start at first_group * group_size
    versions: list[list[int]] | None = None  # per sample, per token: the weight version that sampled it
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler's own scalars (async/*)


def top_k_of(cfg: TrainConfig) -> dict[str, int]:
    """The ``top_k`` keyword of an engine call: none when off, so an engine written before top-k sampling (a
    stand-in with the older signature) is called as before."""
    return {"top_k": cfg.top_k} if cfg.top_k else {}


def step_seed(seed: int, step: int, salt: int) -> int:
    """A 31-bit seed for one purpose (``salt``) at one step: no RNG state to checkpoint, resumes are exact."""
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0] >> 1)

# ---------------------------------------------------------------------------------------------------------------
# rollouts


def sample_batch(engine: Any, task: Task, cfg: TrainConfig, step: int, now: int) -> StepRollouts:
    """Sample the rollouts of step ``step`` while the trainer is at step ``now``: ``prompts_per_step`` problems,
    ``group_size`` responses each. The engine holds the weights of the last sync, step ``now - now % sync_every``."""
    problems = task.sample(random.Random(step_seed(cfg.seed, step, 1)), cfg.prompts_per_step, "train")
    if task.tool is not None:  # multi-turn: the model calls the task's tool, the environment answers
        rollout = tool_rollout(engine, task, problems, n=cfg.group_size, max_tokens=cfg.max_tokens,
                               temperature=cfg.temperature, top_p=cfg.top_p, topk=cfg.topk,
                               seed=step_seed(cfg.seed, step, 2), **top_k_of(cfg))
    else:
        rollout = engine.generate([p.prompt for p in problems], n=cfg.group_size, max_tokens=cfg.max_tokens,
                                  temperature=cfg.temperature, top_p=cfg.top_p, topk=cfg.topk,
                                  seed=step_seed(cfg.seed, step, 2), **top_k_of(cfg))
    per_sample = [problems[i] for i in rollout.prompt_index]
    rewards = task.score(per_sample, rollout.texts, rollout.finish_reasons)
    return StepRollouts(now - now % cfg.sync_every, problems, rollout, torch.tensor(rewards, dtype=torch.float32))


def rollout_stream(engine: Any, task: Task, cfg: TrainConfig, step: int,
                   pending: deque[StepRollouts]) -> Iterator[StepRollouts]:
    """Yield the batch of each step from ``step`` on. ``pending`` holds batches sampled ahead: with
    ``policy_lag = k`` the batch of step s was sampled k steps earlier, with the weights the engine had then
    (asynchronous RL's staleness; the first k steps train on the initial weights' rollouts)."""
    while True:
        while len(pending) <= cfg.policy_lag:
            pending.append(sample_batch(engine, task, cfg, step + len(pending), now=step))
        yield pending.popleft()
        step += 1


# ---------------------------------------------------------------------------------------------------------------
# asynchronous partial rollouts


@dataclass
class Partial:
    """One response being generated across engine calls: its ids so far, mu's logprob and top-K at each, and the
    weight version that sampled each token. ``finish`` is None while in flight."""

    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    mu: list[float] = dataclasses.field(default_factory=list)
    topk_ids: list[list[int]] = dataclasses.field(default_factory=list)
    topk_lps: list[list[float]] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None


@dataclass
class AsyncState:
    """The sampler's state between steps (and in a checkpoint): the groups started and not yet trained, in the
    order they started, the weight version the engine holds, and counters."""

    groups: list[tuple[int, Problem, list[Partial]]] = dataclasses.field(default_factory=list)  # (index, ., G)
    version: int = 0  # the trainer step whose weights the engine holds
    started: int = 0  # groups started so far (the next group's index)
    calls: int = 0  # engine calls so far
    dropped_groups: int = 0  # over the run
    dropped_tokens: int = 0  # tokens sampled for dropped groups, over the run


class PartialRollouts:
    """Asynchronous partial rollouts, interleaved in one process (``async_chunk_tokens > 0``).

    The engine keeps ``async_batches * prompts_per_step`` groups started and not yet trained. One engine call
    extends every response in flight by at most ``async_chunk_tokens`` tokens, continuing from its sampled ids
    (:meth:`Engine.extend`), each new token tagged with the version the engine holds. Between two calls the trainer
    takes at most one step: once ``prompts_per_step`` groups have finished, the oldest of them are the step's batch;
    the trainer updates and syncs the engine (``version``), and the responses still in flight continue under the new
    weights, so one response spans versions. With ``max_staleness = k >= 0``, a group holding a token sampled more
    than k versions before the step that would train it is dropped at once (it could never be trained) and a new
    group takes its place: dropped, not regenerated from the same prompt.

    What is interleaved rather than concurrent: sampling and training alternate in one process, the trainer's step
    taking the time of one engine call; a real asynchronous trainer runs them at once and the number of versions a
    response spans depends on their relative speeds.
    """

    def __init__(self, engine: Any, task: Task, cfg: TrainConfig, state: AsyncState | None = None) -> None:
        self.engine, self.task, self.cfg = engine, task, cfg
        self.state = state or AsyncState()

    def _start_groups(self) -> None:
        """Start new groups until ``async_batches`` steps' worth are started and not yet trained."""
        st, cfg = self.state, self.cfg
        while len(st.groups) < cfg.async_batches * cfg.prompts_per_step:
            problem = self.task.sample(random.Random(step_seed(cfg.seed, st.started, 101)), 1, "train")[0]
            prompt_ids = self.engine.encode([problem.prompt])[0]
            st.groups.append((st.started, problem, [Partial(list(prompt_ids)) for _ in range(cfg.group_size)]))
            st.started += 1

    def _call(self) -> None:
        """One engine call: every response in flight gains at most ``async_chunk_tokens`` tokens."""
        st, cfg = self.state, self.cfg
        live = [r for _, _, rs in st.groups for r in rs if r.finish is None]
        st.calls += 1
        if not live:
            return
        budgets = [min(cfg.async_chunk_tokens, cfg.max_tokens - len(r.ids)) for r in live]
        out = self.engine.extend([r.prompt_ids + r.ids for r in live], budgets, temperature=cfg.temperature,
                                 top_p=cfg.top_p, topk=cfg.topk, seed=step_seed(cfg.seed, st.calls, 102),
                                 **top_k_of(cfg))
        for i, r in enumerate(live):
            r.ids += out.response_ids[i]
            r.mu += out.mu_logprobs[i]
            r.topk_ids += out.mu_topk_ids[i]
            r.topk_lps += out.mu_topk_logprobs[i]
            r.versions += [st.version] * len(out.response_ids[i])
            if out.finish_reasons[i] == "stop":
                r.finish = "stop"
            elif len(r.ids) >= cfg.max_tokens:
                r.finish = "length"

    def _drop_stale(self, step: int) -> int:
        """Drop the groups that step ``step`` or any later one could not train under ``max_staleness``."""
        st, k = self.state, self.cfg.max_staleness
        if k < 0:
            return 0
        keep = []
        for group in st.groups:
            oldest = min((min(r.versions) for r in group[2] if r.versions), default=step)
            if step - oldest > k:
                st.dropped_groups += 1
                st.dropped_tokens += sum(len(r.ids) for r in group[2])
            else:
                keep.append(group)
        dropped = len(st.groups) - len(keep)
        st.groups = keep
        return dropped

    def batch(self, step: int) -> StepRollouts:
        """The batch of step ``step``: engine calls (at least one since the last batch) until ``prompts_per_step``
        groups have finished; the oldest finished ones, in the order they started."""
        cfg, st = self.cfg, self.state
        calls0, dropped = st.calls, 0
        while True:
            dropped += self._drop_stale(step)
            done = [g for g in st.groups if all(r.finish is not None for r in g[2])]
            if st.calls > calls0 and len(done) >= cfg.prompts_per_step:
                break
            self._start_groups()
            self._call()
        chosen = done[: cfg.prompts_per_step]
        taken = {g[0] for g in chosen}
        st.groups = [g for g in st.groups if g[0] not in taken]
        return self._assemble(step, chosen, dropped, st.calls - calls0)

    def _assemble(self, step: int, chosen: list[tuple[int, Problem, list[Partial]]], dropped: int,
                  calls: int) -> StepRollouts:
        """A :class:`StepRollouts` of the chosen groups, with their per-token versions and the sampler's scalars."""
        cfg = self.cfg
        problems = [p for _, p, _ in chosen]
        rs = [r for _, _, group in chosen for r in group]
        texts = self.engine.tokenizer.batch_decode([r.ids for r in rs], skip_special_tokens=True)
        rollout = Rollout(
            prompts=[p.prompt for p in problems], n=cfg.group_size, topk=cfg.topk,
            prompt_index=[i for i in range(len(problems)) for _ in range(cfg.group_size)],
            prompt_ids=[r.prompt_ids for r in rs], response_ids=[r.ids for r in rs], mu_logprobs=[r.mu for r in rs],
            mu_topk_ids=[r.topk_ids for r in rs], mu_topk_logprobs=[r.topk_lps for r in rs],
            finish_reasons=[r.finish or "length" for r in rs], texts=texts, sampling=self.engine.sampling_info())
        per_sample = [problems[i] for i in rollout.prompt_index]
        rewards = torch.tensor(self.task.score(per_sample, texts, rollout.finish_reasons), dtype=torch.float32)
        versions = [v for r in rs for v in r.versions]
        stale = [step - v for v in versions]
        stats = {
            "async/staleness_mean": float(np.mean(stale)) if stale else 0.0,
            "async/staleness_max": float(max(stale, default=0)),
            "async/spanning_frac": float(np.mean([len(set(r.versions)) > 1 for r in rs])),
            "async/engine_calls": float(calls),
            "async/dropped_groups": float(dropped),
            "async/dropped_groups_total": float(self.state.dropped_groups),
            "async/dropped_tokens_total": float(self.state.dropped_tokens),
            "async/in_flight_groups": float(len(self.state.groups)),
        }
        return StepRollouts(min(versions, default=self.state.version), problems, rollout, rewards,
                            versions=[list(r.versions) for r in rs], stats=stats)

    def stream(self, step: int) -> Iterator[StepRollouts]:
        """Yield the batch of each step from ``step`` on (the trainer sets ``state.version`` when it syncs)."""
        while True:
            yield self.batch(step)
            step += 1
