"""Rollout engines on the toy model: vLLM agrees with transformers, top-K lists are well formed, weights sync.

The bf16 figures (printed with ``-s``) are recorded in docs/performance.md.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from trustscope.engines import LOGPROB_FLOOR, Rollout, make_engine
from trustscope.engines.base import RolloutTensors
from trustscope.engines.hf import HFEngine
from trustscope.train.tasks import get_task

pytestmark = pytest.mark.slow

PROMPTS = [p.prompt for p in get_task("add1").split("eval")[:8]] + ["12+7=", "hello"]
K = 5


@pytest.fixture(scope="module")
def vllm_engine(toy_model_dir):
    engine = make_engine("vllm", toy_model_dir, dtype="float32", seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(toy_model_dir) -> HFEngine:
    engine = make_engine("hf", toy_model_dir, dtype="float32", seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(toy_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(toy_model_dir), dtype=torch.float32)


def check_well_formed(r: Rollout, vocab_size: int, eos_id: int, n: int, prompts: list[str]) -> None:
    assert len(r) == len(prompts) * n
    assert r.prompt_index == [i for i in range(len(prompts)) for _ in range(n)]
    for b in range(len(r)):
        ids = r.response_ids[b]
        assert len(ids) >= 1
        assert r.finish_reasons[b] in ("stop", "length")
        assert (ids[-1] == eos_id) == (r.finish_reasons[b] == "stop")
        assert eos_id not in ids[:-1]
        for t, tok in enumerate(ids):
            tk_ids, tk_lps = r.mu_topk_ids[b][t], r.mu_topk_logprobs[b][t]
            assert len(tk_ids) == len(tk_lps) == r.topk
            assert len(set(tk_ids)) == r.topk
            assert all(0 <= i < vocab_size for i in tk_ids)
            assert tok in tk_ids
            assert tk_lps == sorted(tk_lps, reverse=True)
            assert tk_lps[tk_ids.index(tok)] == pytest.approx(r.mu_logprobs[b][t], abs=1e-6)
            assert all(LOGPROB_FLOOR <= lp <= 0.0 for lp in tk_lps)
            assert np.logaddexp.reduce(tk_lps) <= 1e-5  # probabilities of distinct tokens sum to <= 1


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_topk_well_formed(engine_name, vllm_engine, hf_engine):
    engine = vllm_engine if engine_name == "vllm" else hf_engine
    r = engine.generate(PROMPTS, n=4, max_tokens=6, topk=K, seed=1)
    check_well_formed(r, engine.vocab_size, hf_engine.tokenizer.eos_token_id, 4, PROMPTS)
    assert r.texts == hf_engine.tokenizer.batch_decode(r.response_ids, skip_special_tokens=True)
    assert "stop" in r.finish_reasons
    short = engine.generate(["9+9=", "8+7="], n=4, max_tokens=1, topk=K, seed=1)  # answers need 2 + EOS
    assert set(short.finish_reasons) == {"length"} and all(len(x) == 1 for x in short.response_ids)
    assert r.prompt_ids[0] == hf_engine.tokenizer(PROMPTS[0])["input_ids"]
    assert r.sampling["engine"] == engine_name and r.sampling["seed"] == 1


def test_sampled_token_forced_into_topk(vllm_engine):
    """With K = 1 the top-K set is the sampled token itself whenever the sampler did not take the argmax."""
    r = vllm_engine.generate(PROMPTS, n=8, max_tokens=6, topk=1, seed=2)
    for b in range(len(r)):
        for t, tok in enumerate(r.response_ids[b]):
            assert r.mu_topk_ids[b][t] == [tok]
            assert r.mu_topk_logprobs[b][t][0] == pytest.approx(r.mu_logprobs[b][t], abs=1e-6)


def max_diffs(hf: HFEngine, r: Rollout, temperature: float = 1.0) -> tuple[float, float]:
    lp, topk, t = hf.score(r, temperature)
    m = t.mask
    return float(((lp - t.mu_logprob).abs() * m).max()), float(((topk - t.mu_topk_logprobs).abs() * m[..., None]).max())


def test_vllm_matches_transformers_fp32(vllm_engine, hf_engine):
    r = vllm_engine.generate(PROMPTS, n=8, max_tokens=8, topk=K, seed=3)
    sampled, topk = max_diffs(hf_engine, r)
    print(f"\nfp32 vLLM vs HF teacher forcing: sampled max|diff| {sampled:.2e}, top-{K} {topk:.2e}")
    assert sampled < 1e-4 and topk < 1e-4


def test_hf_generate_matches_teacher_forcing(hf_engine):
    r = hf_engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=4)
    sampled, topk = max_diffs(hf_engine, r)
    assert sampled < 1e-4 and topk < 1e-4


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_mu_is_the_sampled_distribution_at_temperature(engine_name, vllm_engine, hf_engine):
    engine = vllm_engine if engine_name == "vllm" else hf_engine
    with pytest.warns(UserWarning, match="temperature=0.7"):
        r = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, temperature=0.7, seed=5)
    assert max(max_diffs(hf_engine, r, temperature=0.7)) < 1e-4
    assert max(max_diffs(hf_engine, r, temperature=1.0)) > 1e-2  # raw logprobs would be a different mu
    assert engine.sampling_info()["temperature"] == 0.7


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_top_p_warns_and_floors_excluded_tokens(engine_name, vllm_engine, hf_engine):
    engine = vllm_engine if engine_name == "vllm" else hf_engine
    with pytest.warns(UserWarning, match="top_p=0.5"):
        r = engine.generate(PROMPTS, n=4, max_tokens=6, topk=K, top_p=0.5, seed=6)
    check_well_formed(r, engine.vocab_size, hf_engine.tokenizer.eos_token_id, 4, PROMPTS)
    lps = [lp for sample in r.mu_topk_logprobs for pos in sample for lp in pos]
    assert LOGPROB_FLOOR in lps  # tokens outside the nucleus: probability 0 under mu
    assert all(lp > LOGPROB_FLOOR for sample in r.mu_logprobs for lp in sample)


def test_vllm_bf16_mismatch_figures_and_trainer_state(toy_model_dir, hf_engine, vllm_engine):
    """bf16 rollouts against the fp32 trainer; starting and closing a second engine leaves the trainer's RNG
    streams, thread count and torch.set_num_threads alone (vLLM seeds the global RNGs and patches the setter),
    and the first engine keeps working."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch.manual_seed(123)
    random.seed(123)
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(123)
    engine = make_engine("vllm", toy_model_dir, dtype="bfloat16", seed=5)
    try:
        r = engine.generate(PROMPTS, n=8, max_tokens=8, topk=K, seed=3)
        assert engine.sampling_info()["dtype"] == "bfloat16"
    finally:
        engine.close()
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert len(vllm_engine.generate(PROMPTS[:2], n=2, max_tokens=4, seed=1)) == 4
    check_well_formed(r, hf_engine.vocab_size, hf_engine.tokenizer.eos_token_id, 8, PROMPTS)
    lp, _, t = hf_engine.score(r)
    diff = (lp - t.mu_logprob).abs()[t.mask]
    print(f"\nbf16 vLLM vs fp32 HF: sampled max|diff| {diff.max():.3e}, mean {diff.mean():.3e}")
    assert 1e-5 < float(diff.max()) < 0.5  # a real, bounded training-inference mismatch


def test_hf_bf16_mismatch_figures(toy_model_dir, hf_engine):
    engine = make_engine("hf", toy_model_dir, dtype="bfloat16", seed=0)
    r = engine.generate(PROMPTS, n=8, max_tokens=8, topk=K, seed=3)
    lp, _, t = hf_engine.score(r)
    diff = (lp - t.mu_logprob).abs()[t.mask]
    print(f"\nbf16 HF vs fp32 HF: sampled max|diff| {diff.max():.3e}, mean {diff.mean():.3e}")
    assert 1e-5 < float(diff.max()) < 0.5


def sgd_step(model: torch.nn.Module, hf: HFEngine, r: Rollout, lr: float = 0.5) -> None:
    """One REINFORCE-like step: make the sampled responses more likely."""
    t = r.to_tensors(pad_id=hf.tokenizer.pad_token_id)
    p = t.prompt_len
    logits = model(input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids).logits
    lp = logits[:, p - 1 : -1].log_softmax(-1).gather(-1, t.response_ids[..., None])[..., 0]  # (B, T)
    loss = -(lp * t.mask).sum() / t.mask.sum()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.sub_(lr * param.grad)


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_update_weights_follows_trainer(engine_name, toy_model_dir, hf_model, vllm_engine, hf_engine):
    engine = vllm_engine if engine_name == "vllm" else make_engine("hf", toy_model_dir)
    reference = make_engine("hf", toy_model_dir)
    try:
        before = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=7)
        model = hf_model.__class__.from_pretrained(str(toy_model_dir), dtype=torch.float32)
        assert model.config.tie_word_embeddings  # the case vLLM's CPU path gets wrong without the lm_head re-pack
        sgd_step(model, reference, before)
        engine.update_weights(model)
        reference.update_weights(model)
        after = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=7)
        new_sampled, new_topk = max_diffs(reference, after)
        old_sampled, _ = max_diffs(hf_engine, after)
        print(f"\n{engine_name} after sync: vs new weights {new_sampled:.2e} / top-K {new_topk:.2e}, vs old {old_sampled:.2e}")
        assert new_sampled < 1e-4 and new_topk < 1e-4
        assert old_sampled > 1e-2
    finally:
        engine.update_weights(hf_model)  # back to the base weights for the other tests
    restored = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=7)
    assert max(max_diffs(hf_engine, restored)) < 1e-4


def test_seeds_reproduce(vllm_engine, hf_engine):
    for engine in (vllm_engine, hf_engine):
        a = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=11)
        b = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=11)
        c = engine.generate(PROMPTS, n=4, max_tokens=8, topk=K, seed=12)
        assert a.response_ids == b.response_ids and a.mu_logprobs == b.mu_logprobs
        assert a.response_ids != c.response_ids
        d, e = engine.generate(PROMPTS, n=4, max_tokens=8), engine.generate(PROMPTS, n=4, max_tokens=8)
        assert d.sampling["seed"] != e.sampling["seed"]


def test_sampling_info(vllm_engine, hf_engine):
    info = vllm_engine.sampling_info()
    assert info["engine"] == "vllm" and info["logprobs_mode"] == "processed_logprobs"
    assert info["dtype"] == "float32" and info["top_k"] == 0 and info["device"] == "cpu" and info["in_process"]
    assert info["llm_kwargs"]["kv_cache_memory_bytes"] > 0 and info["llm_kwargs"]["enforce_eager"]
    hf_info = hf_engine.sampling_info()
    assert hf_info["engine"] == "hf" and hf_info["logprobs_mode"] == "processed_logprobs"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n must"),
        ({"max_tokens": 0}, "max_tokens must"),
        ({"temperature": 0.0}, "temperature must"),
        ({"top_p": 0.0}, "top_p must"),
        ({"top_p": 1.5}, "top_p must"),
        ({"topk": 0}, "topk must"),
        ({"topk": 65}, "topk"),
    ],
)
def test_bad_arguments(vllm_engine, hf_engine, kwargs, field):
    for engine in (vllm_engine, hf_engine):
        if kwargs.get("topk") == 65 and engine is hf_engine:
            continue  # HF has no logprob limit below the vocabulary
        with pytest.raises(ValueError, match=field):
            engine.generate(PROMPTS, **({"n": 1, "max_tokens": 4} | kwargs))
    with pytest.raises(ValueError, match="prompts must"):
        hf_engine.generate("1+1=")


def test_make_engine_errors(toy_model_dir):
    with pytest.raises(ValueError, match="engine name must be one of"):
        make_engine("sglang", toy_model_dir)
    with pytest.raises(ValueError, match="dtype must be"):
        make_engine("hf", toy_model_dir, dtype="float16")


def test_to_tensors_alignment(hf_engine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = hf_engine.generate(PROMPTS, n=2, max_tokens=6, topk=K, seed=8)
    t: RolloutTensors = r.to_tensors(pad_id=0)
    b, tt = len(r), max(len(x) for x in r.response_ids)
    assert t.response_ids.shape == (b, tt) and t.mu_topk_ids.shape == (b, tt, K)
    assert t.mu_logprob.dtype == torch.float32 and t.mask.dtype == torch.bool
    assert t.response_lengths.tolist() == [len(x) for x in r.response_ids]
    p = t.prompt_len
    for i in range(b):
        n_p, n_t = len(r.prompt_ids[i]), len(r.response_ids[i])
        assert t.input_ids[i, p - n_p : p].tolist() == r.prompt_ids[i]
        assert t.input_ids[i, p : p + n_t].tolist() == r.response_ids[i]
        assert t.position_ids[i, p - n_p : p + n_t].tolist() == list(range(n_p + n_t))
        assert t.attention_mask[i].sum() == n_p + n_t
        assert t.mu_logprob[i, :n_t].tolist() == pytest.approx(r.mu_logprobs[i])
        assert not t.mask[i, n_t:].any()
