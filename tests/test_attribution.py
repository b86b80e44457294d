"""The trainer's measured attribution (``explain_tokens``), its sampling options (``top_k``, ``logprobs_mode``,
``keep_sampling_mask``) and ``trustscope explain``'s measured column, on short real runs through the HF engine."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from trustscope.explain.analysis import explain
from trustscope.train.attribution import PREFIX, shapley
from trustscope.train.config import ConfigError, TrainConfig
from trustscope.train.loop import train
from trustscope.train.sampling import MASKED, keep_support, support

SMALL = dict(engine="hf", prompts_per_step=4, group_size=4, max_tokens=6, eval_every=0, save_every=0, steps=3,
             explain_tokens=48)


def _train(tmp_path, run_id: str, **kw) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engines warn on a biased sampler: these runs are biased on purpose
        return train(TrainConfig(run_id=run_id, logdir=str(tmp_path), **{**SMALL, **kw}))


def _measured(scalars: dict[str, float]) -> dict[str, float]:
    return {k[len(PREFIX):]: v for k, v in scalars.items() if k.startswith(PREFIX)}


def test_shapley_values_add_up_to_what_removing_every_cause_takes_away():
    players = ["a", "b", "c"]
    m = {frozenset(): 1.0, frozenset("a"): 0.5, frozenset("b"): 0.8, frozenset("c"): 1.0, frozenset("ab"): 0.2,
         frozenset("ac"): 0.5, frozenset("bc"): 0.8, frozenset("abc"): 0.2}
    phi = shapley(m, players)
    assert math.isclose(sum(phi.values()), m[frozenset()] - m[frozenset("abc")])
    assert phi["c"] == pytest.approx(0.0, abs=1e-12)  # removing c never changes anything: it gets nothing
    assert phi["a"] > phi["b"] > 0


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.9), (7, 0.8), (0, 0.5)])
def test_the_support_is_the_one_transformers_samples_from(top_k, top_p):
    """:func:`support` against transformers' own TopK / TopP logits processors (applied in generate's order)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    z = torch.randn(6, 4, 50, generator=g) * 3  # (B, T, V)
    flat = z.reshape(-1, 50)
    processed = flat.clone()
    if top_k:
        processed = TopKLogitsWarper(top_k)(None, processed)
    if top_p < 1:
        processed = TopPLogitsWarper(top_p)(None, processed)
    theirs = torch.isfinite(processed).reshape(z.shape)
    sampled = z.argmax(-1)  # always inside both supports: the forced token changes nothing here
    assert torch.equal(support(z, sampled, top_p, top_k), theirs)
    outside = (theirs.sum(-1) < 50).nonzero()[0]  # a position with tokens left out
    forced = theirs[tuple(outside)].logical_not().nonzero()[0, 0]  # a token outside its support, sampled anyway
    sampled[tuple(outside)] = forced
    assert support(z, sampled, top_p, top_k)[(*outside, forced)]  # the sampled token is always kept
    masked = keep_support(z, sampled, top_p, top_k)
    assert (masked[~support(z, sampled, top_p, top_k)] == MASKED).all()
    assert torch.isfinite(masked.log_softmax(-1)).all()


def test_the_sampling_options_are_checked_naming_the_field():
    with pytest.raises(ConfigError, match="keep_sampling_mask=True"):
        TrainConfig(run_id="x", keep_sampling_mask=True)
    with pytest.raises(ConfigError, match="logprobs_mode='raw'"):
        TrainConfig(run_id="x", logprobs_mode="raw")
    with pytest.raises(ConfigError, match="top_k=-1"):
        TrainConfig(run_id="x", top_k=-1)
    with pytest.raises(ConfigError, match="explain_tokens=-5"):
        TrainConfig(run_id="x", explain_tokens=-5)


def test_the_keep_sampling_mask_makes_pi_the_distribution_mu_was_drawn_from(tmp_path):
    """top-p 0.9: without the mask pi (full softmax) sits below mu (renormalised over the nucleus) on every token
    the nucleus left something out of; with it the two agree (same model and dtype on both sides)."""
    without = _train(tmp_path, "nomask", top_p=0.9)
    masked = _train(tmp_path, "mask", top_p=0.9, keep_sampling_mask=True)
    assert without[f"{PREFIX}mismatch"] > 1e-3 and _measured(without)["truncation"] > 0.99
    assert masked[f"{PREFIX}mismatch"] < 1e-5  # nothing left to measure: the cause is removed in training
    assert masked["policy/mismatch_abs_mean"] < without["policy/mismatch_abs_mean"] / 10


@pytest.mark.parametrize(("kw", "cause"), [
    (dict(temperature=0.7, logprobs_mode="raw_logprobs"), "temperature"),
    (dict(top_k=4), "truncation"),
    (dict(policy_lag=2, lr=1e-4), "staleness"),
    (dict(engine_dtype="bfloat16"), "numerics"),
])
def test_a_run_with_one_cause_has_the_mismatch_measured_on_that_cause(tmp_path, kw, cause):
    step = _train(tmp_path, cause, **kw)
    scalars = _measured(step)
    assert scalars["mismatch"] > 0 and scalars["tokens"] >= min(SMALL["explain_tokens"], step["tokens"])
    assert scalars[cause] > 0.75, scalars
    others = [c for c in ("temperature", "truncation", "staleness", "numerics", "routing") if c != cause]
    assert all(scalars[c] == 0.0 for c in others), scalars  # a cause the run does not have is never allocated
    total = sum(scalars[c] for c in (*others, cause)) + scalars["unexplained"]
    assert total == pytest.approx(1.0, abs=1e-9)
    # trustscope explain's inferred share agrees with the measured one on a single cause (numerics: unexplained)
    run = explain(tmp_path, cause, replicates=0).runs[0]
    inferred = {c.source: c.share for c in run.run.causes}
    same = "unexplained" if cause == "numerics" else cause
    assert inferred[same] == pytest.approx(run.run.measured[same], abs=0.1), (inferred, run.run.measured)


def test_explain_shows_the_measured_shares_beside_the_inferred(tmp_path):
    """A run with two causes at once (raw log-probs at temperature 0.7, two steps of lag, a bf16 engine): the
    measured shares add up, the two carry it, and ``trustscope explain`` reads them back token-weighted."""
    scalars = _measured(_train(tmp_path, "mix", steps=4, temperature=0.7, logprobs_mode="raw_logprobs",
                               policy_lag=2, lr=1e-4, engine_dtype="bfloat16"))
    parts = [scalars[c] for c in ("temperature", "truncation", "staleness", "numerics", "routing")]
    assert sum(parts) + scalars["unexplained"] == pytest.approx(1.0, abs=1e-9)
    assert scalars["temperature"] > 0.3 and scalars["staleness"] > 0.1
    run = explain(tmp_path, "mix", replicates=0).runs[0]
    measured = run.run.measured
    assert measured is not None and sum(measured.values()) == pytest.approx(1.0, abs=1e-6)
    inferred = {c.source: c.share for c in run.run.causes}
    top = max(("temperature", "staleness"), key=measured.get)
    assert top == max(("temperature", "staleness"), key=inferred.get)  # both name the same largest cause
    assert measured["unexplained"] < 0.2  # numerics (bf16) is small beside the two


def test_raw_logprobs_are_the_untempered_softmax_the_trainer_computes_at_temperature_one(toy_model_dir):
    """The HF engine's raw_logprobs at temperature 0.7: mu is the model's own softmax (what the trainer gets at
    temperature 1), not the tempered distribution it sampled from."""
    from transformers import AutoModelForCausalLM

    from trustscope.engines import make_engine

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with make_engine("hf", toy_model_dir, logprobs_mode="raw_logprobs") as raw, \
                make_engine("hf", toy_model_dir) as processed:
            ro = raw.generate(["1+2=", "3+4="], n=2, max_tokens=4, temperature=0.7, topk=3, seed=5)
            rp = processed.generate(["1+2=", "3+4="], n=2, max_tokens=4, temperature=0.7, topk=3, seed=5)
    assert raw.sampling_info()["logprobs_mode"] == "raw_logprobs"
    assert ro.response_ids == rp.response_ids  # the same draws: only what is reported differs
    gaps = []
    for prompt, ids, mu, mu_processed in zip(ro.prompt_ids, ro.response_ids, ro.mu_logprobs, rp.mu_logprobs,
                                             strict=True):
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            lp = model(seq).logits[0, len(prompt) - 1: -1].log_softmax(-1)  # (T, V)
        own = lp.gather(-1, torch.tensor(ids)[:, None])[:, 0].numpy()
        assert np.allclose(own, mu, atol=1e-4)
        gaps.append(np.abs(np.asarray(mu_processed) - own).max())
    assert max(gaps) > 1e-3  # the processed report is the tempered distribution: not the same numbers


@pytest.mark.slow
def test_vllm_reports_raw_logprobs_and_samples_within_top_k(toy_model_dir):
    """vLLM's own ``logprobs_mode="raw_logprobs"`` through the engine: mu is the model's untempered softmax while
    the draws stay within the top-k support of the tempered distribution."""
    from transformers import AutoModelForCausalLM

    from trustscope.engines import make_engine

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with make_engine("vllm", toy_model_dir, logprobs_mode="raw_logprobs") as engine:
            ro = engine.generate(["1+2=", "3+4=", "5+5="], n=8, max_tokens=4, temperature=0.7, topk=3, seed=5,
                                 top_k=2)
            info = engine.sampling_info()
    assert info["logprobs_mode"] == "raw_logprobs" and info["top_k"] == 2
    for prompt, ids, mu in zip(ro.prompt_ids, ro.response_ids, ro.mu_logprobs, strict=True):
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            lp = model(seq).logits[0, len(prompt) - 1: -1].float().log_softmax(-1)  # (T, V)
        assert np.allclose(lp.gather(-1, torch.tensor(ids)[:, None])[:, 0].numpy(), mu, atol=2e-3)
        ranks = (lp > lp.gather(-1, torch.tensor(ids)[:, None])).sum(-1)  # likelier tokens than the drawn one
        assert (ranks < 2).all()  # top_k=2: every draw is one of the two likeliest


def test_the_report_and_the_explain_page_show_the_measured_shares(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from app.launch import LOGDIR_ENV
    from trustscope.explain.render import report_lines

    _train(tmp_path, "lagged", policy_lag=2, lr=1e-4)
    lines = report_lines(explain(tmp_path, replicates=0))
    assert any(line.startswith("  measured by the trainer: staleness") for line in lines), lines
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app" / "main.py"), default_timeout=60)
    at.run()
    at.switch_page("views/explain.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    table = at.dataframe[0].value
    measured = dict(zip(table["cause"], table["measured by the trainer"], strict=True))
    assert measured["staleness"] > 0.75 and measured["temperature mismatch"] == 0.0
    assert any("measured by the trainer" in c.value for c in at.caption)
