"""The record one ``log_step`` call becomes: :class:`Batch`, made by the input checks, consumed by the writer thread.

The checks (:mod:`trustscope.logger.checks`) fill it with flat, checked numpy rows; the writer thread
(:mod:`trustscope.logger.writer`) computes its summaries over every token row, applies the ``token_fraction``
sample and writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Batch:
    """One call's data, checked and flattened to token rows; owned by the writer thread once queued."""

    step: int
    loss_rule: str
    tokens: dict[str, np.ndarray] | None  # flat columns, N rows (top-K: (N, K))
    samples: dict[str, Any] | None
    scalars: list[tuple[str, float]] = field(default_factory=list)
    n_generated: int = 0  # masked response tokens handed in, before sampling and dropping
    dropped_rows: int = 0  # bad token rows dropped (strict=False)
    part: int = 0  # this call's number within (step, rank)
    summarize: bool = False  # the writer computes the summaries over every token row, then applies ``sampled``
    sampled: np.ndarray | None = None  # (N,) bool: the rows token_fraction keeps, when not yet applied
    summaries: list[dict] = field(default_factory=list)  # rows of the summaries table, over every token
    held_rows: int = 0  # token rows counted against max_buffered_rows until their flush is stored
    routing: Any = None  # the run's RoutingPlan when the call gives expert lists (trustscope.logger.experts)

    def apply_sample(self) -> None:
        """Keep only the token rows of the ``token_fraction`` sample (once the summaries have seen them all)."""
        if self.sampled is not None and self.tokens is not None:
            self.tokens = {name: arr[self.sampled] for name, arr in self.tokens.items()}
        self.sampled = None

    @property
    def n_tokens(self) -> int:
        """Token rows to write (after the token_fraction sample)."""
        if self.tokens is None:
            return 0
        return int(self.sampled.sum()) if self.sampled is not None else len(self.tokens["token_id"])
