"""A run's checkpoints and where a run starts: ``checkpoints/step_<step>/`` (a loadable model directory plus the
trainer's state: optimizer, schedule, rollouts sampled ahead, a lagging engine's weights, partial rollouts in
flight), the newest one found, and :func:`restore`, a new run or a resumed one with the log cut back to its
checkpoint.
"""

from __future__ import annotations

import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.checkpoints")

from trustscope import runformat
from trustscope.engines import DTYPES
from trustscope.logger import drop_steps_after
from trustscope.train.config import TrainConfig
from trustscope.train.rollouts import AsyncState, StepRollouts

CHECKPOINTS = "checkpoints"


def save_checkpoint(cfg: TrainConfig, step: int, model: torch.nn.Module, tokenizer: Any, optimizer: Any,
                    scheduler: Any, pending: deque[StepRollouts], engine_state: dict[str, torch.Tensor] | None,
                    async_state: AsyncState | None = None) -> Path:
    """Write ``checkpoints/step_<step>/``: a loadable HF model dir plus the trainer state; keep the newest few."""
    root = cfg.run_dir / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "pending": list(pending), "engine_state": engine_state, "config": cfg.to_dict(),
                "async_state": async_state}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step_*"))[: -cfg.keep_checkpoints]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step_*`` of a run, or None."""
    found = sorted((run_dir / CHECKPOINTS).glob("step_*"))
    return found[-1] if found else None


def drop_log_after(run_dir: Path, step: int) -> int:
    """Remove log files written after checkpoint ``step`` (a crashed continuation); return how many.

    The trainer flushes the logger at every checkpoint, so each flush holds steps either all <= or all > it;
    :func:`trustscope.logger.drop_steps_after` removes the later flushes and recounts the manifests. A rank whose
    log ends before the checkpoint, or a run of another schema version, is refused naming the run, the rank and
    the steps (:class:`~trustscope.logger.ResumeError`).
    """
    return drop_steps_after(run_dir, step, resume=True)


@dataclass
class Start:
    """Where a run starts: a new run from the model at step 0, a resumed one from its newest checkpoint."""

    step: int  # the first step to train
    weights_dir: Path | str  # the weights (and tokenizer) the trainer loads
    pending: deque[StepRollouts]  # rollouts sampled ahead (policy_lag > 0)
    engine_state: dict[str, torch.Tensor] | None  # a lagging engine's weights at the checkpoint
    trainer_state: dict[str, Any] | None  # the optimizer's and the scheduler's state at the checkpoint
    async_state: AsyncState | None = None  # asynchronous partial rollouts' groups in flight at the checkpoint


def restore(cfg: TrainConfig, model_dir: Path | str, main: bool = True) -> Start:
    """A new run (refused when its log exists already) or, with ``resume``, the newest checkpoint's state; log
    files written after that checkpoint (a crashed continuation) are dropped, by rank 0 (``main``) for all ranks."""
    if not cfg.resume:
        if (cfg.run_dir / runformat.MANIFEST).exists():
            raise FileExistsError(f"run {cfg.run_id!r} already exists in {cfg.logdir}; set resume=true to continue "
                                  f"it, or another run_id")
        return Start(0, model_dir, deque(), None, None)
    ckpt = latest_checkpoint(cfg.run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"resume=true but {cfg.run_dir / CHECKPOINTS} holds no checkpoint; set save_every > 0 "
                                f"in the first run, or resume=false")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if main:
        drop_log_after(cfg.run_dir, state["step"])
    return Start(state["step"] + 1, ckpt, deque(state["pending"]), state["engine_state"], state,
                 state.get("async_state"))

def with_weights(model_dir: Path | str, cfg: TrainConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of the model with the weights ``state`` (to hand a lagging engine its weights on resume)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[cfg.trainer_dtype])
    model.load_state_dict(state)
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's weights."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
