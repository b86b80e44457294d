"""trustscope.capture against a naive full log_softmax, on a tiny randomly initialised Qwen2."""

from __future__ import annotations

import pytest
import torch

from trustscope.capture import CaptureHook, NoLogitsError, capture, fused_head_forward, top_k

V, B, P, T, K = 300, 3, 5, 7, 4


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (B, P + T), generator=g)  # (B, P + T)
    response_ids = input_ids[:, P:]  # (B, T)
    mu_topk_ids = torch.randint(0, V, (B, T, K), generator=g)  # (B, T, K)
    return input_ids, response_ids, mu_topk_ids


def naive(logits, response_ids, mu_topk_ids, start):
    """Reference: full log_softmax, then gather. start: (B,) response start column."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, L, V)
    rows = torch.stack([logp[b, start[b] - 1: start[b] - 1 + T] for b in range(B)])  # (B, T, V)
    lp = rows.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    topk = rows.gather(-1, mu_topk_ids)
    entropy = -(rows.exp() * rows).sum(-1)
    return lp, topk, entropy


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_capture_matches_naive_log_softmax(model, batch, chunk):
    input_ids, response_ids, mu_topk_ids = batch
    logits = model(input_ids).logits  # (B, P + T, V)
    cap = capture(logits, response_ids, response_start=P, mu_topk_ids=mu_topk_ids, chunk_tokens=chunk)
    ref_lp, ref_topk, ref_ent = naive(logits, response_ids, mu_topk_ids, [P] * B)
    assert cap.logprob.shape == (B, T) and cap.topk_logprobs.shape == (B, T, K) and cap.entropy.shape == (B, T)
    assert cap.logprob.dtype == torch.float32
    torch.testing.assert_close(cap.logprob, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.topk_logprobs, ref_topk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.entropy, ref_ent, atol=1e-5, rtol=1e-5)


def test_capture_gradient_matches_naive(model, batch):
    input_ids, response_ids, mu_topk_ids = batch
    logits = model(input_ids).logits.detach()
    w = torch.randn(B, T)
    w_topk = torch.randn(B, T, K)
    a = logits.clone().requires_grad_(True)
    cap = capture(a, response_ids, response_start=P, mu_topk_ids=mu_topk_ids, chunk_tokens=5)
    ((cap.logprob * w).sum() + (cap.topk_logprobs * w_topk).sum()).backward()
    b = logits.clone().requires_grad_(True)
    lp, topk, _ = naive(b, response_ids, mu_topk_ids, [P] * B)
    ((lp * w).sum() + (topk * w_topk).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    assert not cap.entropy.requires_grad


def test_capture_keeps_no_second_vocab_sized_tensor(batch):
    """Saved for backward: the logits themselves (by reference) and O(N * K) tensors, never another (N, V)."""
    _, response_ids, mu_topk_ids = batch
    logits = torch.randn(B, P + T, V, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cap = capture(logits, response_ids, response_start=P, mu_topk_ids=mu_topk_ids, chunk_tokens=2)
    big = [t for t in saved if t.numel() >= B * T * V // 2]
    assert big, "the logits should be saved by reference"
    assert all(t.data_ptr() == logits.data_ptr() for t in big)
    assert all(t.numel() <= B * (P + T) * max(K + 1, 8) for t in saved if t.data_ptr() != logits.data_ptr())
    cap.logprob.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_capture_per_row_start_and_bf16(model, batch):
    input_ids, _, mu_topk_ids = batch
    logits = model(input_ids).logits.detach()
    start = torch.tensor([P, P - 2, 1])
    rows = torch.stack([input_ids[b, s: s + T] for b, s in enumerate(start.tolist())])  # (B, T)
    cap = capture(logits, rows, response_start=start, mu_topk_ids=mu_topk_ids)
    ref_lp, ref_topk, ref_ent = naive(logits, rows, mu_topk_ids, start.tolist())
    torch.testing.assert_close(cap.logprob, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.topk_logprobs, ref_topk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    cap16 = capture(logits.bfloat16(), rows, response_start=start)
    assert cap16.logprob.dtype == torch.float32 and cap16.topk_logprobs is None
    ref16, _, _ = naive(logits.bfloat16(), rows, mu_topk_ids, start.tolist())
    torch.testing.assert_close(cap16.logprob, ref16, atol=1e-5, rtol=1e-5)


def test_capture_hook_records_without_changing_the_loss(model, batch):
    input_ids, response_ids, mu_topk_ids = batch
    plain = model(input_ids).logits.log_softmax(-1)[:, P - 1:-1].gather(-1, response_ids[..., None]).sum()
    with CaptureHook(model, response_ids, response_start=P, mu_topk_ids=mu_topk_ids) as hook:
        out = model(input_ids)
        loss = out.logits.log_softmax(-1)[:, P - 1:-1].gather(-1, response_ids[..., None]).sum()
    torch.testing.assert_close(loss, plain)
    ref_lp, ref_topk, ref_ent = naive(out.logits, response_ids, mu_topk_ids, [P] * B)
    torch.testing.assert_close(hook.result.logprob, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hook.result.topk_logprobs, ref_topk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hook.result.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    assert not hook.result.logprob.requires_grad
    model(input_ids)  # the hook is gone after the block
    assert len(hook.results) == 1


def test_capture_hook_keep_grad_feeds_a_loss(model, batch):
    input_ids, response_ids, _ = batch
    model.zero_grad()
    with CaptureHook(model, response_ids, response_start=P, keep_grad=True) as hook:
        model(input_ids)
    hook.result.logprob.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_capture_rejects_bad_shapes(batch):
    _, response_ids, mu_topk_ids = batch
    logits = torch.randn(B, P + T, V)
    with pytest.raises(ValueError, match="response_start"):
        capture(logits, response_ids)
    with pytest.raises(ValueError, match="response_start must be in"):
        capture(logits, response_ids, response_start=0)
    with pytest.raises(ValueError, match="mu_topk_ids"):
        capture(logits, response_ids, response_start=P, mu_topk_ids=mu_topk_ids[:, :2])
    with pytest.raises(ValueError, match="logits must be"):
        capture(logits[0], response_ids, response_start=P)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_capture_temperature_is_the_samplers_distribution(model, batch, temperature):
    """logits / temperature before the log-softmax, as a sampler at that temperature draws; gradients too."""
    input_ids, response_ids, mu_topk_ids = batch
    logits = model(input_ids).logits.detach()
    a = logits.clone().requires_grad_(True)
    cap = capture(a, response_ids, response_start=P, mu_topk_ids=mu_topk_ids, temperature=temperature, chunk_tokens=4)
    b = logits.clone().requires_grad_(True)
    ref_lp, ref_topk, ref_ent = naive(b / temperature, response_ids, mu_topk_ids, [P] * B)
    torch.testing.assert_close(cap.logprob, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.topk_logprobs, ref_topk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    cap.logprob.sum().backward()
    ref_lp.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    plain = capture(logits, response_ids, response_start=P)
    assert not torch.allclose(plain.logprob, cap.logprob)
    with CaptureHook(model, response_ids, response_start=P, temperature=temperature) as hook:
        model(input_ids)
    torch.testing.assert_close(hook.result.logprob, ref_lp.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_capture_rejects_a_bad_temperature(batch, temperature):
    _, response_ids, _ = batch
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        capture(torch.randn(B, P + T, V), response_ids, response_start=P, temperature=temperature)


def test_top_k_matches_sorted_log_softmax(model, batch):
    input_ids = batch[0]
    logits = model(input_ids).logits.detach()
    ids, lps = top_k(logits, 5, T=T, response_start=P, temperature=0.8, chunk_tokens=3)
    ref = torch.log_softmax(logits[:, P - 1: P - 1 + T] / 0.8, -1).topk(5, dim=-1)
    assert ids.shape == lps.shape == (B, T, 5)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(lps, ref.values, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="k must be in"):
        top_k(logits, V + 1)


class _LogprobsOnly(torch.nn.Module):
    """A model whose output carries per-token log-probs and no logits, like TRL's FusedCausalLMOutput."""

    def forward(self, input_ids):
        return {"log_probs": torch.zeros(input_ids.shape)}


def test_capture_hook_names_the_alternative_for_a_model_without_logits(batch):
    input_ids, response_ids, _ = batch
    with CaptureHook(_LogprobsOnly(), response_ids, response_start=P) as hook, \
            pytest.raises(NoLogitsError, match=r"holds no logits.*capture\(\) on logits"):
        hook.model(input_ids)


def test_capture_hook_refuses_a_fused_lm_head_when_created(model, batch):
    """TRL's add_fused_lm_head replaces the forward with one taking fused_lm_head=...: refused before any step."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    _, response_ids, _ = batch
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    fused = Qwen2ForCausalLM(cfg)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy"))
    assert fused_head_forward(fused) is fused and fused_head_forward(model) is None
    with pytest.raises(NoLogitsError, match=r"fused LM head.*integrations\.trl\.attach"):
        CaptureHook(fused, response_ids, response_start=P)
    wrapper = torch.nn.Sequential(fused)  # found inside a wrapper too
    with pytest.raises(NoLogitsError):
        CaptureHook(wrapper, response_ids, response_start=P)
