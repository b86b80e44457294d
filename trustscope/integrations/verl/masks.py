"""The applied mask of verl's own mask-based loss modes, replayed from pi, pi_old, A and verl's clip settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _clip_bounds(config: Any) -> tuple[float, float]:
    """verl's (low, high) clip settings: ``clip_ratio_low`` / ``clip_ratio_high``, each defaulting to ``clip_ratio``."""
    low, high = config.get("clip_ratio_low", None), config.get("clip_ratio_high", None)
    base = config.get("clip_ratio", 0.2)
    return float(base if low is None else low), float(base if high is None else high)


def vanilla_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``vanilla`` (PPO, dual-clip) loss keeps a gradient. ``(B, T)`` -> ``(B, T)`` bool.

    Zero gradient where the clipped term wins (A > 0 with r > 1 + high, A < 0 with r < 1 - low) and, dual-clip, where
    A < 0 and the clipped objective passes ``clip_ratio_c`` (its loss is the constant ``-A * c`` there).
    """
    low, high = _clip_bounds(config)
    c = float(config.get("clip_ratio_c", 3.0))
    r = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))  # (B, T), verl's clamped ratio
    clipped = ((advantages > 0) & (r > 1 + high)) | ((advantages < 0) & (r < 1 - low))
    dual = (advantages < 0) & (torch.maximum(r, r.clamp(1 - low, 1 + high)) > c)
    return ~(clipped | dual)


def dppo_tv_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``dppo_tv`` keeps a gradient: A > 0 needs p - p_old <= high, A <= 0 needs p - p_old >= -low."""
    low, high = _clip_bounds(config)
    diff = torch.exp(log_prob) - torch.exp(old_log_prob)  # (B, T)
    return torch.where(advantages > 0, diff <= high, diff >= -low)


def dppo_kl_keep(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, config: Any) -> Tensor:
    """Where verl's ``dppo_kl`` keeps a gradient: binary KL(p_old || p) within the bound, or p moved against A."""
    low, high = _clip_bounds(config)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return torch.where(advantages > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))


VERL_MASKS: dict[str, Callable[[Tensor, Tensor, Tensor, Any], Tensor]] = {
    "vanilla": vanilla_keep,
    "dppo_tv": dppo_tv_keep,
    "dppo_kl": dppo_kl_keep,
}
"""The applied mask of verl's own mask-based loss modes, replayed from pi, pi_old, A and verl's clip settings."""
