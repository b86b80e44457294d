"""The toy world's multi-turn preset, ``toy-tool``: the dense toy model warm-started on a tool-use task.

The task (``multool`` by default, see :mod:`trustscope.train.tasks`) has the model call a calculator, the
environment splice its answer in, and the model go on in its next turn. The warm start is the dense toy's
(:func:`trustscope.train.toy.warm_start`'s recipe: AdamW, linear warm-up, gradient clipping, stop at the target)
with one difference: the environment's tokens are inputs, never targets, so the loss and the expected accuracy
cover the model's own tokens only (the call, the next call, the answer and EOS). Expected accuracy is then exact
as in the dense toy: the probability that a temperature-1 rollout writes the reference trajectory's model turns,
given the environment's answers, which is a lower bound of the task's reward.

    from trustscope.train.toy_tool import TOOL_PRESETS, build_toy_tool_model
    model_dir = build_toy_tool_model(TOOL_PRESETS["toy-tool"])

Builds are cached under ``$TRUSTSCOPE_CACHE/toy`` as ``tool-<task>-<key>``, keyed by the configuration and the
source of this module and of :mod:`trustscope.train.toy`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.toy_tool")

from trustscope.paths import cache_root
from trustscope.train import toy
from trustscope.train.builds import staged_build
from trustscope.train.tasks import Problem, get_task, model_spans


@dataclasses.dataclass(frozen=True)
class ToyToolConfig(toy.ToyConfig):
    """A :class:`~trustscope.train.toy.ToyConfig` whose task has a tool (``Task.tool``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if get_task(self.task).tool is None:
            raise ValueError(f"task {self.task!r} has no tool: the toy-tool world needs a multi-turn task "
                             f"(such as 'multool')")

    def key(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("num_threads", "device")}
        blob = (json.dumps(fields, sort_keys=True) + toy.TOY_VERSION + Path(toy.__file__).read_text()
                + Path(__file__).read_text())
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TOOL_PRESETS: dict[str, ToyToolConfig] = {
    "toy-tool": ToyToolConfig(task="multool", target_accuracy=0.2, lr=1e-3, eval_every=5, max_steps=4000),
}
"""Named multi-turn toy worlds: ``toy-tool``, the dense toy (2 layers, 437k parameters) on ``multool``."""


def encode_trajectories(tokenizer: Any, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch for ``prompt + trajectory + EOS`` (the layout of
    :func:`trustscope.train.toy.encode_problems`), ``target_mask`` True on the model's own tokens only: the
    environment's answers are context, not targets. One character is one token here, so the task's per-character
    spans (:func:`trustscope.train.tasks.model_spans`) are per-token spans."""
    input_ids, attention_mask, target_mask = toy.encode_problems(tokenizer, problems)
    for i, p in enumerate(problems):
        spans = model_spans(get_task(p.task), p.answer)
        start = int(target_mask[i].nonzero()[0])  # the trajectory's first token
        env = [start + j for j, by_model in enumerate(spans) if not by_model]
        target_mask[i, env] = False
    return input_ids, attention_mask, target_mask


@torch.no_grad()
def expected_accuracy(model: torch.nn.Module, tokenizer: Any, problems: list[Problem], chunk: int = 512) -> float:
    """Mean over ``problems`` of the probability that a temperature-1 rollout writes the reference trajectory's
    model tokens (EOS included) given the environment's answers."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(problems), chunk):
        total += toy.answer_logprobs(model, encode_trajectories(tokenizer, problems[i : i + chunk])).exp().sum().item()
    model.train(was_training)
    return total / len(problems)


def warm_start(model: torch.nn.Module, tokenizer: Any, config: ToyToolConfig) -> dict[str, Any]:
    """Supervised training on the model tokens of the task's reference trajectories until the eval split's
    expected accuracy reaches the target; raises ``RuntimeError`` when ``max_steps`` pass first."""
    task = get_task(config.task)
    train, held_out = task.split("train", config.seed), task.split("eval", config.seed)
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup, accuracy, loss_value, step = 50, 0.0, math.nan, 0
    model.train()
    for step in range(1, config.max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, step / warmup)
        batch = encode_trajectories(tokenizer, [train[rng.randrange(len(train))] for _ in range(config.batch_size)])
        loss = -toy.answer_logprobs(model, batch).sum() / batch[2].sum().to(model.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        if step % config.eval_every == 0:
            accuracy = expected_accuracy(model, tokenizer, held_out)
            if accuracy >= config.target_accuracy:
                break
    else:
        raise RuntimeError(
            f"warm start on task {config.task!r} reached expected accuracy {accuracy:.3f} after {config.max_steps} "
            f"steps, short of target_accuracy={config.target_accuracy}; raise max_steps or lower the target"
        )
    model.eval()
    return {"steps": step, "train_loss": loss_value, "eval_expected_accuracy": accuracy,
            "eval_problems": len(held_out),
            "train_expected_accuracy": expected_accuracy(model, tokenizer, list(dict.fromkeys(train)))}


def build_toy_tool_model(config: ToyToolConfig | None = None, *, cache_dir: str | Path | None = None,
                         force: bool = False, **overrides: Any) -> Path:
    """Build (or find in the cache) the warm-started multi-turn toy model; return its directory (the layout of
    :func:`trustscope.train.toy.build_toy_model`, ``trustscope_toy.json`` included)."""
    config = dataclasses.replace(config or TOOL_PRESETS["toy-tool"], **overrides)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "toy" / f"tool-{config.task}-{config.key()}"
    if (final / toy.META_FILE).exists() and not force:
        return final
    with staged_build(final, force=force) as tmp:
        start = time.perf_counter()
        tokenizer = toy.toy_tokenizer()
        model = toy.new_toy_model(config, tokenizer).to(config.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(config.num_threads)
        try:
            record = warm_start(model, tokenizer, config)
        finally:
            torch.set_num_threads(threads)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"config": dataclasses.asdict(config), "key": config.key(),
                "parameters": sum(p.numel() for p in model.parameters()),
                "build_seconds": round(time.perf_counter() - start, 2), "warm_start": record}
        (tmp / toy.META_FILE).write_text(json.dumps(meta, indent=2))
    return final
