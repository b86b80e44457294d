"""TRL's loss and sampling settings as ``run.json`` records them (:func:`trl_settings`), and the mask TRL's loss
applied, replayed from them (:func:`trl_kept`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trustscope.integrations.trl.versions import (
    CLIPPED_LOSS_TYPES,
    UNMASKED_LOSS_TYPES,
)


def trl_settings(trainer: Any) -> dict[str, Any]:
    """TRL's loss and sampling settings as plain values, for ``run.json`` (``config["trl"]``)."""
    args = trainer.args
    return {
        "trainer": type(trainer).__name__,
        "loss_type": trainer.loss_type,
        "epsilon_low": float(trainer.epsilon_low),
        "epsilon_high": float(trainer.epsilon_high),
        "delta": None if args.delta is None else float(args.delta),
        "beta": float(trainer.beta),
        "importance_sampling_level": trainer.importance_sampling_level,
        "top_entropy_quantile": float(trainer.top_entropy_quantile),
        "off_policy_mask_threshold": trainer.off_policy_mask_threshold,
        "use_vllm": bool(trainer.use_vllm),
        "vllm_mode": getattr(args, "vllm_mode", None) if trainer.use_vllm else None,
        "vllm_importance_sampling_correction": bool(trainer.vllm_importance_sampling_correction),
        "vllm_importance_sampling_mode": getattr(trainer, "vllm_importance_sampling_mode", None),
        "vllm_importance_sampling_clip_min": getattr(trainer, "vllm_importance_sampling_clip_min", None),
        "vllm_importance_sampling_clip_max": getattr(trainer, "vllm_importance_sampling_clip_max", None),
        "num_generations": int(trainer.num_generations),
        "num_iterations": int(args.num_iterations),
        "steps_per_generation": int(args.steps_per_generation),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "scale_rewards": args.scale_rewards,
        "multi_objective_aggregation": args.multi_objective_aggregation,
        "mask_truncated_completions": bool(args.mask_truncated_completions),
        "reward_weights": [float(w) for w in trainer.reward_weights.tolist()],
        "learning_rate": float(args.learning_rate),
        "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p),
        "top_k": None if trainer.top_k is None else int(trainer.top_k),
        "min_p": None if trainer.min_p is None else float(trainer.min_p),
        "repetition_penalty": float(trainer.repetition_penalty),
        "max_completion_length": int(trainer.max_completion_length),
    }


def trl_kept(
    pi: Tensor,
    old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
    importance_sampling_level: str = "token",
) -> Tensor:
    """The tokens TRL 1.16's policy loss lets through, from its ratio against ``old``: ``(B, T)`` bool.

    ``pi``, ``old``: ``(B, T)`` log-probs (``old`` is TRL's ``old_per_token_logps``, or pi itself when TRL skips
    them); ``advantages`` ``(B,)`` or ``(B, T)``; ``mask`` ``(B, T)`` the tokens the loss covers. For the clipped
    loss types (:data:`CLIPPED_LOSS_TYPES`) a token is blocked where TRL counts it clipped, ``r < 1 - epsilon_low``
    with A < 0 or ``r > 1 + epsilon_high`` with A > 0 (``r`` capped at ``delta`` as TRL caps it), and where
    ``delta`` freezes the ratio of an A < 0 token (``r > delta``: its gradient is zero, though TRL's clip metrics
    do not count it). ``r`` is per token, or per sequence (the masked mean log-ratio) with
    ``importance_sampling_level="sequence"``. The other loss types block nothing here.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    keep = torch.ones_like(pi, dtype=torch.bool)  # (B, T)
    if loss_type in UNMASKED_LOSS_TYPES:
        return keep
    if loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not a TRL loss type trustscope knows: "
                         f"{sorted(CLIPPED_LOSS_TYPES | UNMASKED_LOSS_TYPES)}")
    log_ratio = (pi - old).float()  # (B, T)
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        m = mask.float()
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_w)
    capped = ratio if delta is None else ratio.clamp(max=delta)
    blocked = ((capped < 1 - epsilon_low) & (advantages < 0)) | ((capped > 1 + epsilon_high) & (advantages > 0))
    if delta is not None:
        blocked |= (ratio > delta) & (advantages < 0)
    return keep & ~blocked
