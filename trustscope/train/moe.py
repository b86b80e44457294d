"""Mixture-of-experts routing in the integrated trainer: the engine's experts per position from the rollouts, the
trainer's from its routers at each update, and routing replay (R3, ``--routing-replay``).

Kept out of :mod:`trustscope.train.loop`, which calls four functions: :func:`routing_shape` once a run (is the
model MoE, is routing logged or replayed), :func:`step_routing` once a step, :meth:`StepRouting.forward` around
every policy forward, and :meth:`StepRouting.tokens` when the step is logged.

Replay follows the R3 recipe (arXiv 2510.11370): the experts the inference engine selected are recorded per token
during the rollout and the trainer's forward is forced to the same top-k experts, while the gating weights are
recomputed from the trainer's own router logits at those experts, so the router keeps its gradient. It is applied to
every position the engine ran, prompt included, since the prompt's hidden states feed the response's attention.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.moe")

from trustscope.routing import RouterReplay, moe_shape, padded_routing
from trustscope.train.config import ConfigError, TrainConfig
from trustscope.train.tasks import get_task


def routing_shape(cfg: TrainConfig, model: torch.nn.Module) -> tuple[int, int, int] | None:
    """``(MoE layers, top-k, experts)`` when this run logs or replays routing (an MoE model, ``log_routing`` or
    ``routing_replay``; either engine), else None. ConfigError for replay on a dense model."""
    shape = moe_shape(model.config)
    if cfg.routing_replay and shape is None:
        raise ConfigError(f"routing_replay=True: the model {cfg.model!r} is dense (its config names no experts); "
                          f"set routing_replay=false or train a mixture-of-experts model (e.g. model=toy-moe-flip)")
    if shape is None or not (cfg.log_routing or cfg.routing_replay):
        return None
    if cfg.async_chunk_tokens or get_task(cfg.task).tool is not None:
        # a response's experts would come from several engine calls (chunks, model turns): not captured
        warnings.warn("asynchronous partial rollouts and multi-turn tasks: routed experts are not captured, the "
                      "tokens are logged without them", RuntimeWarning, stacklevel=2)
        return None
    return shape


def engine_kwargs(shape: tuple[int, int, int] | None, cfg: TrainConfig) -> dict[str, Any]:
    """The engine's keyword arguments for routing capture (none for a dense model): required when replaying."""
    return {} if shape is None else {"routing": "required" if cfg.routing_replay else True}


@dataclass
class StepRouting:
    """One step's routing: the engine's experts at every input column ``(B, P + T, L, k)`` (-1 where none), the
    replay hooks, and the trainer's experts as each row's last update used them."""

    replay: RouterReplay
    engine: torch.Tensor  # (B, P + T, L, k) long, -1 outside the positions the engine ran
    prompt_len: int
    replaying: bool
    trainer: torch.Tensor = field(init=False)  # (B, P + T, L, k) int16
    router: torch.Tensor = field(init=False)  # (B, P + T, L, k) int16: the router's own pick before replay
    replaced: list[float] = field(default_factory=list)  # per forward: share of choices replay changed

    def __post_init__(self) -> None:
        self.trainer = torch.full(self.engine.shape, -1, dtype=torch.int16)
        self.router = torch.full(self.engine.shape, -1, dtype=torch.int16)

    @contextlib.contextmanager
    def forward(self, rows: torch.Tensor, keep: int | None = None) -> Iterator[None]:
        """Around one policy forward on batch rows ``rows``: replay the engine's experts (when replaying) and
        record the experts the forward used for the first ``keep`` rows (all when None)."""
        given = self.engine[rows.cpu()] if self.replaying else None
        with self.replay.replayed(given) as tracker:
            yield
        used = torch.from_numpy(tracker.take(len(rows), self.engine.shape[1]))  # (b, P + T, L, k)
        keep = len(rows) if keep is None else keep
        self.trainer[rows.cpu()[:keep]] = used[:keep]
        if self.replaying:
            self.replaced.append(self.replay.replaced)
            own = torch.from_numpy(self.replay.take_own(len(rows), self.engine.shape[1]))
            self.router[rows.cpu()[:keep]] = own[:keep]

    def tokens(self) -> dict[str, torch.Tensor]:
        """Both sides at the response tokens, ``(B, T, L, k)``: the columns ``P - 1 .. P + T - 2`` predict them;
        under replay the router's own pick too (``router_experts``: the logger measures the replace rate)."""
        t = self.engine.shape[1] - self.prompt_len
        cols = slice(self.prompt_len - 1, self.prompt_len + t - 1)
        out = {"engine_experts": self.engine[:, cols].to(torch.int16), "trainer_experts": self.trainer[:, cols]}
        return out | ({"router_experts": self.router[:, cols]} if self.replaying else {})

    def scalars(self) -> dict[str, float]:
        """``routing/replay_replaced``: the share of the trainer router's own (position, layer, slot) choices that
        replay replaced by the engine's (the rate R3 removes), over the step's forwards."""
        return {"routing/replay_replaced": float(np.mean(self.replaced))} if self.replaced else {}


def routed(routing: StepRouting | None, rows: torch.Tensor, keep: int | None = None) -> Any:
    """:meth:`StepRouting.forward` for a step that has routing, else a context that does nothing."""
    return contextlib.nullcontext() if routing is None else routing.forward(rows, keep)


def step_scalars(routing: StepRouting | None) -> dict[str, float]:
    """The step's routing scalars (:meth:`StepRouting.scalars`), none without routing."""
    return {} if routing is None else routing.scalars()


def step_routing(rollout: Any, prompt_len: int, width: int, replay: RouterReplay | None,
                 cfg: TrainConfig) -> StepRouting | None:
    """The step's :class:`StepRouting` from a rollout whose engine captured routing, else None."""
    if replay is None or rollout.routed_experts is None:
        return None
    engine = padded_routing(rollout.routed_experts, [len(p) for p in rollout.prompt_ids], prompt_len, width)
    return StepRouting(replay, torch.from_numpy(engine).long(), prompt_len, cfg.routing_replay)


def replay_hooks(model: torch.nn.Module, shape: tuple[int, int, int] | None) -> RouterReplay | None:
    """The router hooks of ``model`` (the unwrapped module) when the run captures routing."""
    return None if shape is None else RouterReplay(model)
