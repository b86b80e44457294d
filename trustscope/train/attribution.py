"""The measured attribution of a step's mismatch (``explain_tokens``): pi recomputed with each known cause removed.

``trustscope explain`` infers which cause carries a run's mismatch from the logged columns. The integrated trainer
can also *measure* it, because it holds everything a cause changes: each step it draws responses holding at least
``explain_tokens`` tokens and recomputes pi at their sampled tokens with the causes the run has removed, in every
combination:

- ``temperature``: the temperature the engine's reported log-probs carry (1 for ``raw_logprobs``, else the
  sampling temperature) in place of the trainer's;
- ``truncation``: the sampler's top-k / top-p support applied as the engine's report applies it (renormalised over
  the support for ``processed_logprobs``, none for ``raw_logprobs``) in place of the trainer's (its
  ``keep_sampling_mask``);
- ``staleness``: each token's pi under the weights that sampled it (``policy_version``), kept at every engine sync;
- ``numerics``: the forward in the engine's dtype (``engine_dtype``) instead of the trainer's;
- ``routing``: an MoE forward with the engine's experts replayed (a run without routing replay).

A cause the run does not have (the same temperature on both sides, no lag, one dtype, a dense model or replay on)
changes nothing when removed, and its share is 0 without a forward. With ``m(S)`` the mean ``|log pi - log mu|``
over the drawn tokens with the causes ``S`` removed, each cause's share is its Shapley value of
``m(none) - m(S)`` divided by ``m(none)``; ``unexplained`` is ``m(all) / m(none)``: what stays once every
measurable cause is removed (the engine's kernels, batch shapes, and the causes a recompute cannot remove). The
shares and ``unexplained`` add up to 1. They go into the step's scalars (:data:`PREFIX` + cause), beside
``explain/measured/mismatch`` and ``explain/measured/tokens``.

What it cannot measure: a position shift or token drift (the trainer logs what it trained on; there is nothing to
remove), and the engine's own kernels (it recomputes with the trainer's model code).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.attribution")

from trustscope.train.sampling import keep_support

PREFIX = "explain/measured/"
"""The step scalars' prefix: ``explain/measured/<cause>``, ``.../unexplained``, ``.../mismatch``, ``.../tokens``."""
CAUSES = ("temperature", "truncation", "staleness", "numerics", "routing")
"""The causes a recompute removes, in the order reported."""
KEEP_VERSIONS = 16
"""Weight versions kept for the staleness recompute (the newest; a token older than all of them is recomputed at
the oldest kept and counted in ``explain/measured/too_old``)."""


@dataclass(frozen=True)
class Sides:
    """How each side computes the distribution at a token: its temperature and whether it truncates."""

    temperature: float
    truncates: bool


def sides(cfg: Any) -> tuple[Sides, Sides]:
    """The trainer's and the engine's report's :class:`Sides` under ``cfg``."""
    truncating = cfg.top_p < 1 or cfg.top_k > 0
    raw = cfg.logprobs_mode == "raw_logprobs"
    trainer = Sides(cfg.temperature, truncating and cfg.keep_sampling_mask)
    engine = Sides(1.0 if raw else cfg.temperature, truncating and not raw)
    return trainer, engine


class WeightVersions:
    """CPU copies of the weights the engine held, by version (the newest :data:`KEEP_VERSIONS`)."""

    def __init__(self, keep: int = KEEP_VERSIONS) -> None:
        self.keep = keep
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, version: int, model: torch.nn.Module) -> None:
        self.states[version] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        for old in sorted(self.states)[: -self.keep]:
            del self.states[old]

    def nearest(self, version: int) -> int:
        """``version`` when kept, else the oldest kept version (the closest there is)."""
        return version if version in self.states else min(self.states)


class Attribution:
    """The measured attribution of one run: a probe copy of the model (with its own router hooks when the run has
    routing) that every recompute loads weights into, so the training model is never touched."""

    def __init__(self, cfg: Any, model: torch.nn.Module, routing: tuple[int, int, int] | None, start: int) -> None:
        from trustscope.train import moe

        self.cfg = cfg
        self.trainer, self.engine = sides(cfg)
        self.probe = copy.deepcopy(model).eval()
        for p in self.probe.parameters():
            p.requires_grad_(False)
        self.replay = moe.replay_hooks(self.probe, routing)
        self.versions = WeightVersions()
        self.versions.add(start, model)

    def synced(self, version: int, model: torch.nn.Module) -> None:
        """The engine now holds ``model``'s weights as ``version``."""
        self.versions.add(version, model)

    def active(self, step: int, versions: np.ndarray, x: Any) -> list[str]:
        """The causes this step has: removing any other changes nothing."""
        out = []
        if self.trainer.temperature != self.engine.temperature:
            out.append("temperature")
        if self.trainer.truncates != self.engine.truncates:
            out.append("truncation")
        if (versions < step).any():
            out.append("staleness")
        if self.cfg.engine_dtype != self.cfg.trainer_dtype:
            out.append("numerics")
        if x.routing is not None and not x.routing.replaying:
            out.append("routing")
        return out

    @torch.no_grad()
    def measure(self, step: int, model: torch.nn.Module, x: Any, versions: np.ndarray) -> dict[str, float]:
        """The step's scalars: draw responses (seeded by the step) until they hold ``explain_tokens`` tokens, then
        the Shapley shares of their mismatch over the active causes."""
        rows = self.draw(step, x.mask)
        if not len(rows):
            return {}
        mask = x.mask[rows].bool()  # (b, T)
        drawn = versions[rows.cpu().numpy()]  # (b, T) each drawn token's sampling version
        ver = torch.as_tensor(drawn, device=mask.device)
        active = self.active(step, drawn[mask.cpu().numpy()], x)
        current = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        logits: dict[tuple[bool, bool, bool], torch.Tensor] = {}

        def forward(stale: bool, numerics: bool, routing: bool) -> torch.Tensor:
            """(b, T, V) float32 logits of the drawn rows, per token at its own version when ``stale``."""
            key = (stale, numerics, routing)
            if key not in logits:
                logits[key] = self._forward(x, rows, current, ver if stale else None, numerics, routing, step)
            return logits[key]

        def mismatch(removed: frozenset[str]) -> float:
            z = forward("staleness" in removed, "numerics" in removed, "routing" in removed)
            side_t = self.engine.temperature if "temperature" in removed else self.trainer.temperature
            side_trunc = self.engine.truncates if "truncation" in removed else self.trainer.truncates
            z = z / side_t
            if side_trunc:
                z = keep_support(z, x.response_ids[rows], self.cfg.top_p, self.cfg.top_k)
            lp = z.log_softmax(-1).gather(-1, x.response_ids[rows, :, None]).squeeze(-1)  # (b, T)
            return float((lp - x.mu_lp[rows]).abs()[mask].mean())

        values = {s: mismatch(s) for s in _subsets(active)}
        total = values[frozenset()]
        out = {f"{PREFIX}mismatch": total, f"{PREFIX}tokens": float(mask.sum())}
        shares = shapley(values, active)
        for cause in CAUSES:
            out[f"{PREFIX}{cause}"] = shares.get(cause, 0.0) / total if total > 0 else 0.0
        out[f"{PREFIX}unexplained"] = values[frozenset(active)] / total if total > 0 else 1.0
        if "staleness" in active:
            kept = min(self.versions.states)
            out[f"{PREFIX}too_old"] = float(((ver < kept) & mask).sum())
        return out

    def draw(self, step: int, mask: torch.Tensor) -> torch.Tensor:
        """Rows in a seeded random order until they hold ``explain_tokens`` tokens (or every row)."""
        order = torch.randperm(mask.shape[0], generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + step))
        counts = mask.sum(-1).cpu()[order]
        enough = int(torch.searchsorted(counts.cumsum(0), self.cfg.explain_tokens)) + 1
        return order[:enough].to(mask.device)

    def _forward(self, x: Any, rows: torch.Tensor, current: Mapping[str, torch.Tensor], ver: torch.Tensor | None,
                 numerics: bool, routing: bool, step: int) -> torch.Tensor:
        from trustscope.engines import DTYPES

        t = x.response_ids.shape[1]
        dtype, own = DTYPES[self.cfg.engine_dtype if numerics else self.cfg.trainer_dtype], DTYPES[self.cfg.trainer_dtype]
        if ver is None:
            at = {None: None}
        else:  # each token at its sampling version (the oldest kept where it is older than every kept one)
            nearest = torch.empty_like(ver)
            for v in ver.unique().tolist():
                nearest[ver == v] = self.versions.nearest(int(v))
            at = {int(v): nearest == v for v in nearest.unique().tolist()}
        out = None
        for version, where in at.items():
            self.probe.to(own)  # loaded at full precision, then cast: never a bf16 round trip of the weights
            self.probe.load_state_dict(current if version is None else self.versions.states[version])
            self.probe.to(dtype)
            given = x.routing.engine[rows.cpu()] if routing else None
            context = self.replay.replayed(given) if self.replay is not None else contextlib.nullcontext()
            with context as tracker:
                z = self.probe(input_ids=x.inputs["input_ids"][rows], attention_mask=x.inputs["attention_mask"][rows],
                               position_ids=x.inputs["position_ids"][rows], logits_to_keep=t + 1).logits[:, :t].float()
            if tracker is not None:
                tracker.take(len(rows), x.inputs["input_ids"].shape[1])  # the recompute's experts are not logged
            out = z if out is None else torch.where(where[..., None], z, out)
        return out


def _subsets(items: Iterable[str]) -> list[frozenset[str]]:
    items = list(items)
    return [frozenset(c) for r in range(len(items) + 1) for c in itertools.combinations(items, r)]


def shapley(values: Mapping[frozenset[str], float], players: list[str]) -> dict[str, float]:
    """Each player's Shapley value of the game ``v(S) = values[{}] - values[S]`` (the mismatch a removal takes
    away): ``sum over S not holding p of |S|! (n - |S| - 1)! / n! * (v(S + p) - v(S))``. They add up to
    ``v(all players)``."""
    n = len(players)
    out = {}
    for p in players:
        others = [q for q in players if q != p]
        total = 0.0
        for s in _subsets(others):
            weight = math.factorial(len(s)) * math.factorial(n - len(s) - 1) / math.factorial(n)
            total += weight * (values[s] - values[s | {p}])
        out[p] = total
    return out
