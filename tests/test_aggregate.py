"""trustscope.losses.aggregate: every mode against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trustscope.losses import AGGREGATIONS, aggregate

# Sequence 0: tokens 1, 2, 3. Sequence 1: token 4, then padding. Sequence 2: padding only.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, math.nan, math.inf], [7.0, 7.0, 7.0]])  # (B, T)
MASK = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])  # (B, T)


@pytest.mark.parametrize(("mode", "expected"), [
    ("token_mean", 10 / 4),                      # all valid tokens, one vote each
    ("seq_mean_token_mean", (6 / 3 + 4 / 1) / 2),  # sequences with no token are left out
    ("seq_mean_token_sum", (6 + 4 + 0) / 3),      # every row counts
    ("seq_mean_token_sum_norm", 10 / (3 * 3)),    # Dr. GRPO: constant B * T
])
def test_modes_by_hand(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_default_mode_is_the_papers_recipe():
    assert aggregate(LOSS, MASK).item() == pytest.approx(10 / 9)
    assert aggregate(LOSS, MASK, max_len=5).item() == pytest.approx(10 / 15)
    assert aggregate(LOSS, MASK.float(), "token_mean").item() == pytest.approx(2.5)


def test_length_bias_as_documented():
    """Doubling a sequence's length (same per-token loss) moves token_mean but not seq_mean_token_mean."""
    short = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]])
    long = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    m_short = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    m_long = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert aggregate(short, m_short, "seq_mean_token_mean") == aggregate(long, m_long, "seq_mean_token_mean")
    assert aggregate(short, m_short, "token_mean") < aggregate(long, m_long, "token_mean")
    assert aggregate(long, m_long, "seq_mean_token_sum") == 4 * aggregate(long, m_long, "seq_mean_token_sum_norm")
    for name, fn in AGGREGATIONS.items():
        assert "Length bias:" in (fn.__doc__ or ""), name


def test_gradient_reaches_only_valid_tokens():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    aggregate(loss, mask, "seq_mean_token_mean").backward()
    assert loss.grad.tolist() == [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"mode='mean' is not one of \['seq_mean_token_mean'"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match=r"loss \(3, 3\) and mask \(3, 2\)"):
        aggregate(LOSS, MASK[:, :2])
    with pytest.raises(ValueError, match="max_len=0"):
        aggregate(LOSS, MASK, max_len=0)
