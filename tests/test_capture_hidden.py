"""trustscope.capture.logprobs_from_hidden against a full log_softmax of the logits, on random cases and on tiny
Qwen3 models (tied and untied heads), in float32 and bf16, through a vocabulary-parallel split of the head."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trustscope.capture import (
    VocabShard,
    combine_head_partials,
    head_partial,
    logprobs_from_hidden,
    top_k_from_hidden,
)


def full_logprobs(hidden, weight, bias=None, temperature=1.0, logit_scale=1.0, softcap=None):
    """Reference: the whole ``(N, V)`` logits, as a plain LM head computes them, then log_softmax in float32."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    z = logits.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.log_softmax(z / temperature, dim=-1)  # (N, V)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), h=st.integers(1, 12), v=st.integers(2, 90), k=st.integers(1, 6),
       temperature=st.sampled_from([1.0, 0.6, 1.7]), with_bias=st.booleans(), from_label=st.booleans(),
       softcap=st.sampled_from([None, 5.0]), chunk_tokens=st.integers(1, 9), chunk_vocab=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_random_cases_equal_a_full_softmax(n, h, v, k, temperature, with_bias, from_label, softcap, chunk_tokens,
                                           chunk_vocab, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g) * 2
    weight = torch.randn(v, h, generator=g)
    bias = torch.randn(v, generator=g) if with_bias else None
    ids = torch.randint(0, v, (n, k), generator=g)
    ref = full_logprobs(hidden, weight, bias, temperature, 1.3, softcap)  # (N, V)
    label = {}
    if from_label:
        label_ids = torch.randint(0, v, (n,), generator=g)
        label = {"label_ids": label_ids, "label_logprobs": ref.gather(1, label_ids[:, None])[:, 0]}
    out = logprobs_from_hidden(hidden, weight, ids, bias=bias, temperature=temperature, logit_scale=1.3,
                               softcap=softcap, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, **label)
    assert out.shape == (n, k) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref.gather(1, ids), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("from_label", [False, True])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_gradients_pass_the_float64_check(from_label, softcap):
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 6, 5, 23, 3
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, v, (n, k), generator=g)
    labels = torch.randint(0, v, (n,), generator=g)

    def f(hidden, weight, bias):
        kw = {}
        if from_label:  # the label's log-prob carries its own gradient, as a fused head's output does
            lp = torch.log_softmax(softcap * torch.tanh((hidden @ weight.t() + bias) / softcap) / 0.8
                                   if softcap else (hidden @ weight.t() + bias) / 0.8, -1)
            kw = {"label_ids": labels, "label_logprobs": lp.gather(1, labels[:, None])[:, 0]}
        return logprobs_from_hidden(hidden, weight, ids, bias=bias, temperature=0.8, softcap=softcap,
                                    chunk_tokens=4, chunk_vocab=7, **kw)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def qwen3(tied: bool, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen3_head_tied_or_not_gives_the_full_logits_values_and_gradients(tied):
    model = qwen3(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 257, (2, 12), generator=g)
    ids = torch.randint(0, 257, (2, 11, 5), generator=g)  # (B, T, K): mu's top-K at positions 0..10
    weights = torch.randn(2, 11, 5, generator=g)

    logits = model(input_ids).logits[:, :-1]  # (B, T, V)
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, ids)
    (ref * weights).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    hidden = model.model(input_ids).last_hidden_state[:, :-1]  # (B, T, H)
    out = logprobs_from_hidden(hidden, model.lm_head.weight, ids, temperature=0.7, chunk_tokens=5, chunk_vocab=60)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    (out * weights).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("from_label", [False, True])
def test_bf16_equals_the_bf16_logits_log_softmax(from_label):
    model = qwen3(tied=False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 257, (3, 16), generator=g)
    ids = torch.randint(0, 257, (3, 16, 4), generator=g)
    with torch.no_grad():
        hidden = model.model(input_ids).last_hidden_state  # (B, L, H) bf16
        ref = full_logprobs(hidden, model.lm_head.weight, temperature=0.9)  # the bf16 logits, then float32
        kw = {}
        if from_label:
            kw = {"label_ids": input_ids, "label_logprobs": ref.gather(-1, input_ids[..., None])[..., 0]}
        out = logprobs_from_hidden(hidden, model.lm_head.weight, ids, temperature=0.9, chunk_vocab=50, **kw)
    assert out.dtype == torch.float32
    # the gather's dot products and the GEMM round to bf16 apart: a logit (and log Z from the label's) may land an
    # ulp of the bf16 logits away, 2 ** -7 of the largest logit, no more
    ulp = 2.0 ** -7 * float((hidden @ model.lm_head.weight.t()).detach().float().abs().max()) / 0.9
    err = (out - ref.gather(-1, ids)).abs()
    assert float(err.max()) <= 2 * ulp
    assert float(err.mean()) < ulp / 4  # most dot products round alike


def test_two_vocabulary_shards_combine_to_the_whole_head():
    g = torch.Generator().manual_seed(3)
    n, h, v, k = 9, 6, 50, 4
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (n, k), generator=g)
    ids[0] = torch.tensor([0, 20, 21, 49])  # both edges of the split
    ref = full_logprobs(hidden, weight, bias, temperature=1.4).gather(1, ids)
    ref.sum().backward()
    ref_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None

    parts = [head_partial(hidden, weight[a:b], ids, bias=bias[a:b], vocab_start=a, temperature=1.4, chunk_vocab=8)
             for a, b in ((0, 21), (21, 50))]  # uneven shards
    out = combine_head_partials(parts)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    out.sum().backward()
    for t, r in zip((hidden, weight, bias), ref_grads, strict=True):
        torch.testing.assert_close(t.grad, r, atol=1e-5, rtol=1e-4)

    # from the label: each shard adds the label's logit where it owns it, and no shard sums over its rows
    labels = torch.randint(0, v, (n,), generator=g)
    lp = full_logprobs(hidden, weight, bias, temperature=1.4).gather(1, labels[:, None])[:, 0]
    with_label = torch.cat([labels[:, None], ids], 1)
    parts = [head_partial(hidden, weight[a:b], with_label, bias=bias[a:b], vocab_start=a, temperature=1.4,
                          log_normaliser=False) for a, b in ((0, 21), (21, 50))]
    assert all(p.log_normaliser is None for p in parts)
    torch.testing.assert_close(combine_head_partials(parts, lp), ref, atol=2e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 20), v=st.integers(3, 120), k=st.integers(1, 8), with_bias=st.booleans(),
       chunk_vocab=st.integers(1, 50), temperature=st.sampled_from([1.0, 0.5]), seed=st.integers(0, 2**16))
def test_top_k_from_hidden_is_the_full_softmax_top_k(n, v, k, with_bias, chunk_vocab, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    k = min(k, v)
    hidden, weight = torch.randn(2, n, 6, generator=g), torch.randn(v, 6, generator=g)
    bias = torch.randn(v, generator=g) if with_bias else None
    labels = torch.randint(0, v, (2, n), generator=g)
    ref = full_logprobs(hidden, weight, bias, temperature)  # (2, n, V)
    ids, lps, label_lp = top_k_from_hidden(hidden, weight, k, bias=bias, label_ids=labels, temperature=temperature,
                                           chunk_tokens=7, chunk_vocab=chunk_vocab)
    want = ref.topk(k, dim=-1)
    assert ids.shape == lps.shape == (2, n, k) and label_lp.shape == (2, n)
    torch.testing.assert_close(lps, want.values, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ref.gather(-1, ids), want.values, atol=2e-5, rtol=1e-5)  # the same ids (ties aside)
    torch.testing.assert_close(label_lp, ref.gather(-1, labels[..., None])[..., 0], atol=2e-5, rtol=1e-5)


class _Sizes(TorchDispatchMode):
    """The largest tensor any op makes, in elements."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("from_label", [False, True])
def test_no_tensor_grows_with_tokens_times_vocabulary(from_label):
    n, h, v, k = 256, 4, 2000, 8
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (n, k), generator=g)
    kw = {}
    if from_label:
        lp = full_logprobs(hidden, weight).gather(1, ids[:, :1])[:, 0].detach()  # a fused head tiles its own
        kw = {"label_ids": ids[:, 0], "label_logprobs": lp}
    with _Sizes() as sizes:
        out = logprobs_from_hidden(hidden, weight, ids, chunk_tokens=32, chunk_vocab=100, **kw)
        out.sum().backward(inputs=[hidden, weight])
    # the largest: the weight's own gradient (V, H), one tile (chunk_tokens, chunk_vocab) or the gathered head
    # rows (N, 1 + K, H); never (N, V)
    assert sizes.largest <= max(v * h, 32 * 100, n * (k + 1) * h) < n * v // 25
    assert hidden.grad is not None and weight.grad.shape == (v, h)
    with _Sizes() as sizes:
        top_k_from_hidden(hidden, weight, k, label_ids=ids[:, 0], chunk_tokens=32, chunk_vocab=100)
    assert sizes.largest <= max(v * h, 32 * 100, n * (k + 1) * h) < n * v // 25


def test_bad_input_is_refused_naming_the_tensor_and_the_index():
    hidden, weight = torch.randn(3, 4, 8), torch.randn(20, 8)
    ids = torch.randint(0, 20, (3, 4, 2))
    with pytest.raises(ValueError, match=r"hidden of shape \(3, 4, 7\).*weight of shape \(20, 8\)"):
        logprobs_from_hidden(torch.randn(3, 4, 7), weight, ids)
    bad = ids.clone()
    bad[1, 2, 1] = 20
    with pytest.raises(ValueError, match=r"ids of shape \(3, 4, 2\): index \(1, 2, 1\) = 20 is outside the "
                                         r"vocabulary \[0, 20\)"):
        logprobs_from_hidden(hidden, weight, bad)
    bad[1, 2, 1] = -1
    with pytest.raises(ValueError, match=r"index \(1, 2, 1\) = -1"):
        logprobs_from_hidden(hidden, weight, bad)
    labels, lps = torch.randint(0, 20, (3, 4)), -torch.rand(3, 4)
    lps[2, 0] = math.nan
    with pytest.raises(ValueError, match=r"label_logprobs of shape \(3, 4\): index \(2, 0\) = nan is not finite"):
        logprobs_from_hidden(hidden, weight, ids, label_ids=labels, label_logprobs=lps)
    lps[2, 0] = -math.inf
    with pytest.raises(ValueError, match=r"index \(2, 0\) = -inf is not finite"):
        logprobs_from_hidden(hidden, weight, ids, label_ids=labels, label_logprobs=lps)
    with pytest.raises(ValueError, match="label_ids and label_logprobs go together"):
        logprobs_from_hidden(hidden, weight, ids, label_ids=labels)
    with pytest.raises(ValueError, match=r"ids of shape \(3, 2\) must be \(\*, K\)"):
        logprobs_from_hidden(hidden, weight, ids[:, 0])
    with pytest.raises(ValueError, match=r"shard rows \[15, 35\)"):
        logprobs_from_hidden(hidden, weight, ids, shard=VocabShard(start=15, vocab_size=30))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(hidden, weight, ids, temperature=0.0)


def _gloo_rank(rank: int, world: int, init: str, case: dict, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        hidden = case["hidden"].clone().requires_grad_(True)
        a, b = case["bounds"][rank]
        weight = case["weight"][a:b].clone().requires_grad_(True)
        result = {}
        for mode in ("chunked", "label"):
            kw = {"label_ids": case["labels"], "label_logprobs": case["label_lp"]} if mode == "label" else {}
            lp = logprobs_from_hidden(hidden, weight, case["ids"], temperature=0.9, chunk_vocab=7,
                                      shard=VocabShard(start=a, vocab_size=case["weight"].shape[0]), **kw)
            (lp * case["w"]).sum().backward()
            result[mode] = (lp.detach(), hidden.grad.clone(), weight.grad.clone())
            hidden.grad = weight.grad = None
        out[rank] = result
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_two_process_gloo_group_of_vocabulary_shards(tmp_path):
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(5)
    n, h, v, k = 7, 6, 40, 3
    case = {"hidden": torch.randn(n, h, generator=g), "weight": torch.randn(v, h, generator=g),
            "ids": torch.randint(0, v, (n, k), generator=g), "labels": torch.randint(0, v, (n,), generator=g),
            "w": torch.randn(n, k, generator=g), "bounds": [(0, 17), (17, 40)]}
    case["label_lp"] = full_logprobs(case["hidden"], case["weight"], temperature=0.9).gather(
        1, case["labels"][:, None])[:, 0]
    hidden = case["hidden"].clone().requires_grad_(True)
    weight = case["weight"].clone().requires_grad_(True)
    ref = full_logprobs(hidden, weight, temperature=0.9).gather(1, case["ids"])
    (ref * case["w"]).sum().backward()

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", case, out), nprocs=2, join=True)
        out = dict(out)
    for mode in ("chunked", "label"):
        lps = [out[r][mode][0] for r in (0, 1)]
        for lp in lps:  # every rank holds the whole result
            torch.testing.assert_close(lp, ref.detach(), atol=2e-5, rtol=1e-5)
        # the hidden state's gradient is the sum of the ranks' (the framework all-reduces it, as for any
        # column-parallel layer's input); each rank's weight gradient is its rows' slice of the whole head's
        if mode == "chunked":
            torch.testing.assert_close(out[0][mode][1] + out[1][mode][1], hidden.grad, atol=1e-5, rtol=1e-4)
            for r, (a, b) in enumerate(case["bounds"]):
                torch.testing.assert_close(out[r][mode][2], weight.grad[a:b], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["trl", "hidden", "logits"])
def test_the_production_shapes_bench_measures_on_the_device_it_is_given(case):
    """bench/bench_production_shapes.py's measurement at a toy size, --device cpu (scripts/gpu_sanity.sh runs it on
    cuda): it checks pi's top-K it computed is finite and of shape (1, T, K)."""
    import argparse

    from bench import bench_production_shapes as bench
    args = argparse.Namespace(vocab=500, layers=1, preset="qwen3-0.6b", k=4, device="cpu", dtype="float32",
                              warmup=0, threads=0, no_backward=False)
    result = bench.measure(args, case, 16)
    assert result["case"] == case and result["tokens"] == 16 and result["pass_s"] >= result["capture_s"] >= 0
    assert result["backward_s"] > 0 and result["peak_rss_gib"] >= result["rss_before_gib"] > 0
