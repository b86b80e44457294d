"""trustscope.divergence: the paper's worked examples, bounds, K = 1 == binary, extreme probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trustscope import divergence as D


def lp(*p: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in p], dtype=torch.float64).to(dtype)


# --- reference values in float64, written from PAPER.md --------------------------------------------------------


def ref_binary_kl(mu: float, pi: float) -> float:
    return mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu) / (1 - pi))


def full_tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def full_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - q.log())).sum(-1)


# --- worked examples -----------------------------------------------------------------------------------------------


def test_rare_token_example():
    mu, pi = lp(1e-4), lp(1e-2)
    assert D.ratio(pi, mu).item() == pytest.approx(100.0, rel=1e-5)
    assert D.binary_tv(mu, pi).item() == pytest.approx(0.0099, abs=1e-6)
    assert D.binary_kl(mu, pi).item() == pytest.approx(0.0095, abs=1e-4)
    assert D.binary_kl(mu, pi).item() == pytest.approx(ref_binary_kl(1e-4, 1e-2), rel=1e-5)


def test_head_token_example():
    mu, pi = lp(0.99), lp(0.80)
    assert D.ratio(pi, mu).item() == pytest.approx(0.80 / 0.99, rel=1e-6)
    assert D.binary_tv(mu, pi).item() == pytest.approx(0.19, abs=1e-6)
    assert D.binary_kl(mu, pi).item() == pytest.approx(0.181, abs=5e-4)
    assert D.binary_kl(mu, pi).item() == pytest.approx(ref_binary_kl(0.99, 0.80), rel=1e-5)


def test_kl_direction_is_mu_to_pi():
    mu, pi = lp(0.3), lp(0.9)
    assert D.binary_kl(mu, pi).item() == pytest.approx(ref_binary_kl(0.3, 0.9), rel=1e-5)
    assert D.binary_kl(mu, pi).item() != pytest.approx(ref_binary_kl(0.9, 0.3), rel=1e-2)


def test_k3_and_log_ratio():
    mu, pi = lp(0.5, 0.01), lp(0.25, 0.02)
    r = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(D.ratio(pi, mu), r)
    torch.testing.assert_close(D.k3_kl(mu, pi), (r - 1) - r.log())
    big = D.ratio(torch.tensor([0.0]), torch.tensor([-50.0]))
    assert big.item() == pytest.approx(math.exp(20.0), rel=1e-6)


# --- top-K ---------------------------------------------------------------------------------------------------------


def test_topk_hand_computed():
    p = torch.tensor([0.5, 0.3])  # rest 0.2
    q = torch.tensor([0.4, 0.1])  # rest 0.5
    tv = 0.5 * (0.1 + 0.2 + 0.3)
    kl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(3.0) + 0.2 * math.log(0.2 / 0.5)
    assert D.topk_tv(p.log(), q.log()).item() == pytest.approx(tv, rel=1e-6)
    assert D.topk_kl(p.log(), q.log()).item() == pytest.approx(kl, rel=1e-5)


def test_topk_k1_equals_binary():
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(2000, generator=g, dtype=torch.float64).clamp(1e-9, 1 - 1e-6).log()
    pi = torch.rand(2000, generator=g, dtype=torch.float64).clamp(1e-9, 1 - 1e-6).log()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        m, p = mu.to(dtype), pi.to(dtype)
        torch.testing.assert_close(D.topk_tv(m[:, None], p[:, None]), D.binary_tv(m, p), rtol=tol, atol=tol)
        torch.testing.assert_close(D.topk_kl(m[:, None], p[:, None]), D.binary_kl(m, p), rtol=tol * 10, atol=tol)


def test_topk_padded_ids_with_minus_inf():
    mu = torch.tensor([[math.log(0.6), -math.inf]])
    pi = torch.tensor([[math.log(0.5), math.log(0.1)]])
    expected = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.4)
    assert D.topk_kl(mu, pi).item() == pytest.approx(expected, abs=1e-6)
    assert torch.isfinite(D.topk_tv(mu, pi)).all()


def _dist(logits: list[float]) -> torch.Tensor:
    return torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)


def test_the_other_bucket_of_float32_top_k_is_not_a_cancellation():
    """Top-2 of three tokens whose third holds 1.2e-4 of pi: the bucket 1 - sum(P) cancels in float32 (a 5e-4
    relative error, 9e-5 nats of KL above the full KL, hypothesis found it); taken in float64 it stays within 2e-5."""
    mu, pi = _dist([0.0, 0.0, 0.0]), _dist([2.0, 6.0, -3.0])
    ids = torch.tensor([0, 1])  # the third token (pi's 1.2e-4) is the bucket
    mu_k, pi_k = mu[ids].log().float(), pi[ids].log().float()
    assert D.topk_kl(mu_k, pi_k).item() <= full_kl(mu, pi).item() * (1 + 2e-5) + 2e-5
    assert D.topk_tv(mu_k, pi_k).item() <= full_tv(mu, pi).item() + 2e-5


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    v=st.integers(2, 8),
)
def test_topk_is_a_lower_bound_of_full_vocab(data, v):
    logits = st.lists(st.floats(-8, 8), min_size=v, max_size=v)
    mu, pi = _dist(data.draw(logits)), _dist(data.draw(logits))
    k = data.draw(st.integers(1, v))
    sampled = data.draw(st.integers(0, v - 1))
    ids = torch.argsort(mu, descending=True)[:k]
    ids, _ = D.force_sampled_into_topk(ids, mu[ids].log(), torch.tensor(sampled), mu[sampled].log())
    assert sampled in ids.tolist()
    for dtype in (torch.float64, torch.float32):
        mu_k, pi_k = mu[ids].log().to(dtype), pi[ids].log().to(dtype)
        tv, kl = D.topk_tv(mu_k, pi_k).item(), D.topk_kl(mu_k, pi_k).item()
        tol = 1e-9 if dtype == torch.float64 else 2e-5
        assert 0.0 <= tv <= 1.0
        assert kl >= 0.0
        assert tv <= full_tv(mu, pi).item() + tol
        assert kl <= full_kl(mu, pi).item() * (1 + tol) + tol
        if k == v:  # every id listed: the 'other' bucket is empty and top-K is exact
            assert tv == pytest.approx(full_tv(mu, pi).item(), abs=tol * 10)
        if dtype == torch.float64:
            bt = D.binary_tv(mu[sampled].log(), pi[sampled].log()).item()
            assert tv >= bt - 1e-12 or k == 1


def test_force_sampled_into_topk():
    ids = torch.tensor([[5, 3, 9], [1, 2, 4]])
    lps = torch.tensor([[-0.25, -2.0, -3.0], [-0.5, -1.0, -2.0]])
    new_ids, new_lps = D.force_sampled_into_topk(ids, lps, torch.tensor([7, 2]), torch.tensor([-6.0, -1.0]))
    assert new_ids.tolist() == [[5, 3, 7], [1, 2, 4]]
    assert new_lps.tolist() == [[-0.25, -2.0, -6.0], [-0.5, -1.0, -2.0]]
    assert ids.tolist() == [[5, 3, 9], [1, 2, 4]]  # inputs untouched
    with pytest.raises(ValueError, match=r"sampled_ids must have shape \(2,\)"):
        D.force_sampled_into_topk(ids, lps, torch.tensor([7]), torch.tensor([-6.0]))
    with pytest.raises(ValueError, match="sampled_logprobs"):
        D.force_sampled_into_topk(ids, lps, torch.tensor([7, 2]), torch.tensor([-6.0]))
    with pytest.raises(ValueError, match="topk_ids and topk_logprobs"):
        D.force_sampled_into_topk(ids, lps[:, :2], torch.tensor([7, 2]), torch.tensor([-6.0, -1.0]))


def test_topk_shape_errors():
    with pytest.raises(ValueError, match=r"same shape, got \(2, 3\) and \(2, 2\)"):
        D.topk_tv(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="K >= 1"):
        D.topk_kl(torch.zeros(2, 0), torch.zeros(2, 0))


# --- numerics ------------------------------------------------------------------------------------------------------

EXTREMES = [1e-12, 1e-9, 1e-4, 0.3, 0.5, 1 - 1e-4, 1 - 1e-6, 1 - 1e-7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_extreme_probabilities_are_finite_and_accurate(dtype):
    pairs = [(a, b) for a in EXTREMES for b in EXTREMES]
    mu = torch.tensor([math.log(a) for a, _ in pairs], dtype=torch.float64).to(dtype)
    pi = torch.tensor([math.log(b) for _, b in pairs], dtype=torch.float64).to(dtype)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tv, kl = D.binary_tv(mu, pi), D.binary_kl(mu, pi)
    tk_tv, tk_kl = D.topk_tv(mu[:, None], pi[:, None]), D.topk_kl(mu[:, None], pi[:, None])
    for t in (tv, kl, tk_tv, tk_kl, D.ratio(pi, mu), D.k3_kl(mu, pi)):
        assert t.dtype == out_dtype
        assert torch.isfinite(t).all()
    # Reference in float64 on the values the function actually received (after rounding to `dtype`).
    m64, p64 = mu.double().exp().tolist(), pi.double().exp().tolist()
    rest_m = (-torch.expm1(mu.double())).tolist()
    rest_p = (-torch.expm1(pi.double())).tolist()
    for i, (m, p) in enumerate(zip(m64, p64, strict=True)):
        ref_tv = abs(p - m)
        ref_kl = m * (math.log(m) - math.log(p)) + rest_m[i] * (
            math.log(max(rest_m[i], D.EPS)) - math.log(max(rest_p[i], D.EPS))
        )
        ref_kl = max(ref_kl, 0.0)
        assert tv[i].item() == pytest.approx(ref_tv, rel=1e-5, abs=1e-12)
        assert kl[i].item() == pytest.approx(ref_kl, rel=1e-4, abs=1e-6)
        assert tk_tv[i].item() == pytest.approx(ref_tv, rel=1e-5, abs=1e-7)
        assert tk_kl[i].item() == pytest.approx(ref_kl, rel=1e-4, abs=1e-6)


def test_complement_near_one_is_not_lost():
    # 1 - p for p = 1 - 1e-7 must come out as 1e-7, not 0 or 1.19e-7 (float32 subtraction).
    mu, pi = lp(1 - 1e-7), lp(1 - 1e-6)
    ref = ref_binary_kl(1 - 1e-7, 1 - 1e-6)
    assert D.binary_kl(mu, pi).item() == pytest.approx(ref, rel=2e-2)
    assert D.log1mexp(lp(1 - 1e-7)).item() == pytest.approx(math.log(1e-7), rel=1e-5)


def test_batched_over_leading_shape():
    g = torch.Generator().manual_seed(1)
    mu = torch.log_softmax(torch.randn(3, 4, 5, generator=g), -1)
    pi = torch.log_softmax(torch.randn(3, 4, 5, generator=g), -1)
    assert D.topk_tv(mu, pi).shape == (3, 4)
    assert D.binary_kl(mu, pi).shape == (3, 4, 5)
    flat = D.topk_kl(mu.reshape(12, 5), pi.reshape(12, 5)).reshape(3, 4)
    torch.testing.assert_close(D.topk_kl(mu, pi), flat)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_numpy_topk_pair_matches_torch(k):
    # The logger's writer thread computes topk_tv / topk_kl without torch: the same numbers, extremes included.
    import numpy as np

    from trustscope import divergence_np

    g = torch.Generator().manual_seed(k)
    logits = torch.randn(4000, 64, generator=g, dtype=torch.float64) * torch.rand(4000, 1, generator=g) * 12
    mu = torch.log_softmax(logits, -1).topk(k, -1).values  # (N, K), from near-uniform to one token near 1
    pi = (mu + 0.3 * torch.randn(mu.shape, generator=g, dtype=torch.float64)).clamp(max=0.0)
    pi[:50] = mu[:50]  # identical lists: both divergences exactly 0
    tv, kl = D.topk_divergences_np(mu.float().numpy(), pi.float().numpy())
    mu32, pi32 = mu.float().double(), pi.float().double()  # the float32 inputs the logger stores, in float64
    assert tv.dtype == kl.dtype == np.float32
    np.testing.assert_allclose(tv, D.topk_tv(mu32, pi32).numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(kl, D.topk_kl(mu32, pi32).numpy(), rtol=1e-6, atol=1e-12)
    assert (tv[:50] == 0).all() and (kl[:50] == 0).all()
    assert divergence_np.EPS == D.EPS
    with pytest.raises(ValueError, match="top-K"):
        D.topk_divergences_np(mu.numpy(), pi[:, :-1].numpy())
