"""The toy model: local character tokenizer, cached atomic builds, and a base model with room for RL."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from trustscope import paths
from trustscope.engines import make_engine
from trustscope.train import toy
from trustscope.train.tasks import get_task


def test_tokenizer_is_character_level():
    tok = toy.toy_tokenizer()
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "12+7="
    assert tok.decode([*tok("-19", add_special_tokens=False)["input_ids"], tok.eos_token_id]) == "-19<|eos|>"
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert len(tok) == len(toy.SPECIAL_TOKENS) + len(toy.CHARSET)


def test_config_validation():
    with pytest.raises(ValueError, match="head_dim"):
        toy.ToyConfig(hidden_size=64, num_attention_heads=4)  # head_dim 16: vLLM's CPU attention rejects it
    with pytest.raises(ValueError, match="target_accuracy"):
        toy.ToyConfig(target_accuracy=1.0)
    with pytest.raises(ValueError, match="unknown task"):
        toy.ToyConfig(task="nope")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        toy.ToyConfig(batch_size=0)


def test_cache_key():
    base = toy.ToyConfig()
    assert base.key() == toy.ToyConfig().key()
    assert base.key() != dataclasses.replace(base, seed=1).key()
    assert base.key() != dataclasses.replace(base, task="arith").key()
    assert base.key() == dataclasses.replace(base, num_threads=2).key()  # threads do not change the model


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    assert paths.cache_root() == tmp_path
    monkeypatch.delenv(paths.CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert paths.cache_root().parts[-2:] == (".cache", "trustscope")


@pytest.mark.slow
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    small = {"target_accuracy": 0.02, "eval_every": 5, "hidden_size": 64, "num_attention_heads": 2}
    path = toy.build_toy_model(**small)
    assert path.parent == tmp_path / "toy"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary directory left behind
    meta = toy.toy_meta(path)
    assert meta["warm_start"]["eval_expected_accuracy"] >= 0.02
    assert meta["config"]["hidden_size"] == 64 and meta["key"] == path.name.split("-")[-1]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).exists()
    mtime = (path / toy.META_FILE).stat().st_mtime_ns
    assert toy.build_toy_model(**small) == path and (path / toy.META_FILE).stat().st_mtime_ns == mtime
    model, tok = toy.load_toy_model(path)
    assert model.config.head_dim == 32 and len(tok) == model.config.vocab_size


def test_warm_start_fails_loudly_when_target_unreached(tmp_path):
    with pytest.raises(RuntimeError, match="short of target_accuracy"):
        toy.build_toy_model(target_accuracy=0.99, max_steps=2, eval_every=1, cache_dir=tmp_path)
    assert list((tmp_path / "toy").iterdir()) == []  # the failed build left nothing


def test_toy_meta_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a toy model"):
        toy.toy_meta(tmp_path)


def test_default_model_is_tiny_qwen2(toy_model_dir):
    config = json.loads((toy_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)
    meta = toy.toy_meta(toy_model_dir)
    assert meta["parameters"] < 1_000_000
    assert 0.2 <= meta["warm_start"]["eval_expected_accuracy"] <= 0.8


@pytest.mark.slow
def test_base_accuracy_in_range_when_sampled(toy_model_dir):
    """Sampled at temperature 1, the base model solves between 20% and 80%, as its exact expectation says."""
    task = get_task("add1")
    problems = task.split("train") + task.split("eval")
    engine = make_engine("hf", toy_model_dir, seed=0)
    n = 8
    r = engine.generate([p.prompt for p in problems], n=n, max_tokens=6, topk=1, seed=0)
    rewards = task.score([problems[i] for i in r.prompt_index], r.texts, r.finish_reasons)
    sampled = sum(rewards) / len(rewards)
    expected = toy.expected_accuracy(engine.model, engine.tokenizer, problems)
    print(f"\nbase model on add1 (train + eval, {len(rewards)} samples): sampled {sampled:.3f}, exact {expected:.3f}")
    assert 0.2 <= sampled <= 0.8
    assert abs(sampled - expected) < 4 * math.sqrt(0.25 / len(rewards)) + 0.02
    engine.close()


def test_expected_accuracy_is_probability_of_exact_answer(toy_model_dir):
    model, tok = toy.load_toy_model(toy_model_dir)
    problems = get_task("add1").split("eval")[:4]
    probs = toy.solve_probabilities(model, tok, problems)
    for p, prob in zip(problems, probs, strict=True):
        ids = tok(p.prompt + p.answer)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        n_prompt = len(tok(p.prompt)["input_ids"])
        target = torch.tensor(ids[n_prompt:])
        manual = lp[n_prompt - 1 :].gather(-1, target[:, None]).sum().exp().item()
        assert prob == pytest.approx(manual, rel=1e-4)


def test_presets():
    assert toy.TOY_PRESETS["toy"] == toy.ToyConfig()
    v2 = toy.TOY_PRESETS["toy-v2"]
    assert v2.task == "addcol2" and v2.num_hidden_layers > toy.ToyConfig().num_hidden_layers
    assert len({c.key() for c in toy.TOY_PRESETS.values()}) == len(toy.TOY_PRESETS)
    assert toy.TOY_PRESETS["toy-gpu"].device == "cuda"
    # the device the warm start ran on does not name a different model
    assert dataclasses.replace(v2, device="cuda").key() == v2.key()
    with pytest.raises(ValueError, match="device must be"):
        toy.ToyConfig(device="tpu")


def test_warm_start_on_worked_answers(tmp_path):
    """The warm start teacher-forces the whole worked solution (tens of tokens) of a column-addition task."""
    tok = toy.toy_tokenizer()
    problems = get_task("addcol2").split("train")[:3]
    target = toy.encode_problems(tok, problems)[2]
    assert target.sum(-1).tolist() == [len(p.answer) + 1 for p in problems]  # the answer's characters and EOS
    with pytest.raises(RuntimeError, match="short of target_accuracy"):
        toy.build_toy_model(task="addcol2", target_accuracy=0.9, max_steps=2, eval_every=1, batch_size=8,
                            hidden_size=64, num_attention_heads=2, cache_dir=tmp_path)
