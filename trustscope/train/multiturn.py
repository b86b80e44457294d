"""Multi-turn rollouts for tasks with a tool (``Task.tool``): the model calls, the environment answers, the model
goes on, tokens in and tokens out.

One trajectory, as :func:`tool_rollout` builds it::

    prompt ids | turn 0: sampled ids ... call_end | tool: reply ids | turn 1: sampled ids ... | ... | EOS

Turn ``k + 1`` is sampled from ``prompt ids + every id so far`` (:meth:`~trustscope.engines.base.Engine.extend`,
with the call's end as a stop id): the history is never decoded and tokenized again, so the ids the trainer scores are the ids the
engine sampled. The environment's reply is tokenized on its own (``add_special_tokens=False``) and spliced in; its
tokens are in the trainer's input but not in the loss or the log (``Rollout.sampled`` False there: no log-prob
from the engine, none padded in). Each sampled token carries its turn (0 for the first model turn, 1 after the
first tool answer, ...) and the id the engine returned for it, which the trainer logs as ``turn`` and
``engine_token_id``. The whole trajectory (the model's turns and the replies) shares one budget, ``max_tokens``,
as TRL's ``max_completion_length`` does; a reply that would leave no room for another token ends the trajectory
(``finish_reason = "length"``).

:func:`evaluate_tool` is the trainer's evaluation for such tasks: greedy turns of the trainer's own weights
(transformers ``generate``), the same splicing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.multiturn")

from trustscope.engines.base import LOGPROB_FLOOR, Rollout, request_seeds
from trustscope.train.tasks import Problem, Task


def call_end_id(tokenizer: Any, task: Task) -> int:
    """The token id that closes a tool call of ``task`` (its ``tool.call_end`` must be one token)."""
    ids = tokenizer(task.tool.call_end, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"task {task.name!r}: tool.call_end={task.tool.call_end!r} is {len(ids)} tokens {ids} in "
                         f"this tokenizer; a call must end on one token")
    return ids[0]


@dataclass
class Trajectory:
    """One response being built turn by turn: the ids after the prompt and, per id, whether the engine sampled it,
    its turn, mu, mu's top-K and the engine's own id."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    mu: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lps: list[list[float]] = field(default_factory=list)
    engine_ids: list[int] = field(default_factory=list)
    finish: str = "length"

    def add_turn(self, ids: list[int], turn: int, mu: list[float] | None = None,
                 topk_ids: list[list[int]] | None = None, topk_lps: list[list[float]] | None = None) -> None:
        """Append a model turn's sampled ids (with the engine's mu and top-K, when sampled by an engine)."""
        self.ids += ids
        self.sampled += [True] * len(ids)
        self.turns += [turn] * len(ids)
        self.engine_ids += ids
        self.mu += mu if mu is not None else [0.0] * len(ids)
        self.topk_ids += topk_ids if topk_ids is not None else [[i] for i in ids]
        self.topk_lps += topk_lps if topk_lps is not None else [[0.0] for _ in ids]

    def add_reply(self, ids: list[int], turn: int, pad_id: int, k: int) -> None:
        """Append the environment's reply: in the input, out of the loss (no engine log-prob, none padded in)."""
        self.ids += ids
        self.sampled += [False] * len(ids)
        self.turns += [turn] * len(ids)
        self.engine_ids += [-1] * len(ids)
        self.mu += [0.0] * len(ids)
        self.topk_ids += [[pad_id] * k for _ in ids]
        self.topk_lps += [[LOGPROB_FLOOR] * k for _ in ids]


def next_turn(traj: Trajectory, turn_ids: list[int], turn: int, task: Task, tokenizer: Any, max_tokens: int,
              stop_id: int) -> list[int] | None:
    """After a model turn has been added: the environment's reply ids when the turn called the tool and the reply
    leaves room for another model token, else None (the trajectory is done; ``traj.finish`` says how)."""
    if turn_ids and turn_ids[-1] == tokenizer.eos_token_id:
        traj.finish = "stop"
        return None
    if not turn_ids or turn_ids[-1] != stop_id or turn >= task.tool.max_calls:
        return None  # out of budget (or, on the last turn, a call nobody answers)
    reply = task.tool.reply(tokenizer.decode(turn_ids, skip_special_tokens=True))
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    if len(traj.ids) + len(reply_ids) >= max_tokens:
        return None
    return reply_ids


def tool_rollout(engine: Any, task: Task, problems: list[Problem], *, n: int, max_tokens: int, temperature: float,
                 top_p: float, topk: int, seed: int, top_k: int = 0) -> Rollout:
    """``n`` multi-turn trajectories per problem (grouped by problem, as :meth:`Engine.generate`'s samples are):
    up to ``task.tool.max_calls + 1`` rounds of :meth:`~trustscope.engines.base.Engine.extend` over the
    trajectories still going, the tool's replies spliced in between. Returns a :class:`Rollout` whose
    ``sampled``, ``turns`` and ``engine_ids`` say, per token, who wrote it, its turn and the engine's id."""
    if task.tool is None:
        raise ValueError(f"task {task.name!r} has no tool; tool_rollout is for multi-turn tasks")
    tokenizer = engine.tokenizer
    stop_id = call_end_id(tokenizer, task)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = [tokenizer(p.prompt)["input_ids"] for p in problems]
    trajs = [Trajectory(prompt_ids[i // n]) for i in range(len(problems) * n)]
    active = list(range(len(trajs)))
    seeds = request_seeds(seed, task.tool.max_calls + 1)
    sampling: dict[str, Any] = {}
    for turn in range(task.tool.max_calls + 1):
        if not active:
            break
        out = engine.extend([trajs[i].prompt_ids + trajs[i].ids for i in active],
                            [max_tokens - len(trajs[i].ids) for i in active], temperature=temperature, top_p=top_p,
                            topk=topk, seed=seeds[turn], stop_token_ids=[stop_id] if turn < task.tool.max_calls else [],
                            **({"top_k": top_k} if top_k else {}))
        sampling = out.sampling
        still = []
        for j, i in enumerate(active):
            ids = out.response_ids[j]
            trajs[i].add_turn(ids, turn, out.mu_logprobs[j], out.mu_topk_ids[j], out.mu_topk_logprobs[j])
            reply = next_turn(trajs[i], ids, turn, task, tokenizer, max_tokens, stop_id)
            if reply is not None:
                trajs[i].add_reply(reply, turn, pad_id, topk)
                still.append(i)
        active = still
    return Rollout(
        prompts=[p.prompt for p in problems], n=n, topk=topk, prompt_index=[i // n for i in range(len(trajs))],
        prompt_ids=[t.prompt_ids for t in trajs], response_ids=[t.ids for t in trajs],
        mu_logprobs=[t.mu for t in trajs], mu_topk_ids=[t.topk_ids for t in trajs],
        mu_topk_logprobs=[t.topk_lps for t in trajs], finish_reasons=[t.finish for t in trajs],
        texts=tokenizer.batch_decode([t.ids for t in trajs], skip_special_tokens=True),
        sampling={**sampling, "seed": seed, "multi_turn": {"max_calls": task.tool.max_calls,
                                                           "call_end": task.tool.call_end}},
        sampled=[t.sampled for t in trajs], turns=[t.turns for t in trajs], engine_ids=[t.engine_ids for t in trajs],
    )


def turn_summary(rollout: Rollout) -> dict[str, float]:
    """Step scalars of a multi-turn rollout: model turns per response (mean), tool calls answered per response
    (mean), and the share of response tokens the environment wrote."""
    if rollout.turns is None or rollout.sampled is None:
        return {}
    turns = [max(t) + 1 if t else 0 for t in rollout.turns]
    env = sum(len(s) - sum(s) for s in rollout.sampled)
    total = sum(len(s) for s in rollout.sampled)
    calls = [sum(1 for a, b in itertools.pairwise(s) if a and not b) for s in rollout.sampled]
    return {"multiturn/turns_mean": float(np.mean(turns)), "multiturn/tool_calls_mean": float(np.mean(calls)),
            "multiturn/env_token_frac": env / max(1, total)}


@torch.no_grad()
def evaluate_tool(model: torch.nn.Module, tokenizer: Any, task: Task, problems: list[Problem], max_tokens: int,
                  device: torch.device) -> list[float]:
    """Greedy multi-turn rewards of ``model`` on ``problems``: each turn one left-padded ``generate`` over the
    trajectories still going, stopping at EOS or a call's end, the tool's replies spliced in between."""
    stop_id = call_end_id(tokenizer, task)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trajs = [Trajectory(tokenizer(p.prompt)["input_ids"]) for p in problems]
    active = list(range(len(trajs)))
    for turn in range(task.tool.max_calls + 1):
        if not active:
            break
        rows = [trajs[i].prompt_ids + trajs[i].ids for i in active]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (b, L), left-padded
        attention = torch.zeros((len(rows), width), dtype=torch.long)  # (b, L)
        for j, r in enumerate(rows):
            input_ids[j, width - len(r):] = torch.tensor(r)
            attention[j, width - len(r):] = 1
        stops = [tokenizer.eos_token_id] + ([stop_id] if turn < task.tool.max_calls else [])
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=False,
                             max_new_tokens=max(max_tokens - len(trajs[i].ids) for i in active),
                             pad_token_id=pad_id, eos_token_id=stops)
        still = []
        for j, i in enumerate(active):
            gen = out[j, width:].tolist()[: max_tokens - len(trajs[i].ids)]
            ends = [k for k, tok in enumerate(gen) if tok in stops]
            ids = gen[: ends[0] + 1] if ends else gen
            trajs[i].add_turn(ids, turn)
            reply = next_turn(trajs[i], ids, turn, task, tokenizer, max_tokens, stop_id)
            if reply is not None:
                trajs[i].add_reply(reply, turn, pad_id, 1)
                still.append(i)
        active = still
    texts = tokenizer.batch_decode([t.ids for t in trajs], skip_special_tokens=True)
    return task.score(problems, texts, [t.finish for t in trajs])
