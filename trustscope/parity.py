"""``trustscope parity``: the same token sequences through the rollout engine and the trainer's forward at the
same weights, before a run starts, with tolerance bands on the log-prob differences.

The engine (vLLM, or transformers ``generate``) samples responses to the prompts at its dtype; the trainer's forward
(transformers, at the trainer's dtype) scores the same tokens, teacher-forced. Each response token's difference
``d = log pi - log mu`` (trainer minus engine) is reported: the share of tokens with ``|d|`` within 1e-3, 1e-2 and
0.1, the largest with their text, by position bucket, the first generated token apart (where most of the
discrepancy of a prefill/decode split shows), and on a mixture-of-experts model by routing agreement (see
:mod:`trustscope.routing`). A band ``TOL=SHARE`` (at least SHARE of the tokens within TOL) that is broken makes
the command exit 1, so it runs in CI before a run starts.

The tokens are logged as a trustscope run (mu = the engine, pi = pi_old = the trainer, advantage 0), so every page
and ``trustscope doctor`` read it; on an MoE model each token carries its ``routing_agreement``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_TOLERANCES = (1e-3, 1e-2, 1e-1)
"""The tolerances every report shows (share of tokens with ``|log pi - log mu|`` within each)."""


class ParityInputError(ValueError):
    """A model directory that is not a causal LM, a band that does not parse, a prompts file that is empty."""


@dataclass(frozen=True)
class Band:
    """At least ``share`` of the tokens have ``|log pi - log mu| <= tol``; ``first``: only the first generated
    token of each response counts."""

    tol: float
    share: float
    first: bool = False

    def __str__(self) -> str:
        return f"{'first:' if self.first else ''}{self.tol:g}={self.share:g}"


_BAND = re.compile(r"(first:)?([^=]+)=(.+)")


def parse_band(text: str) -> Band:
    """``TOL=SHARE`` or ``first:TOL=SHARE`` (e.g. ``1e-2=0.99``): TOL a finite number > 0, SHARE a number in
    (0, 1]. ParityInputError naming the band otherwise."""
    m = _BAND.fullmatch(text.strip())
    if not m:
        raise ParityInputError(f"--band {text!r}: expected TOL=SHARE (e.g. 1e-2=0.99: at least 99% of tokens within "
                               f"1e-2), optionally prefixed first: for the first generated token")
    try:
        tol, share = float(m.group(2)), float(m.group(3))
    except ValueError:
        raise ParityInputError(f"--band {text!r}: TOL and SHARE must be numbers") from None
    if not (math.isfinite(tol) and tol > 0):
        raise ParityInputError(f"--band {text!r}: tolerance {m.group(2)!r} must be a finite number > 0")
    if not (0 < share <= 1):
        raise ParityInputError(f"--band {text!r}: share {m.group(3)!r} must be a number in (0, 1]")
    return Band(tol, share, bool(m.group(1)))


def check_causal_lm(model_dir: str | Path) -> Any:
    """The transformers config of ``model_dir``; ParityInputError when it is not a causal LM directory."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ParityInputError(f"--model {model_dir}: no config.json there; expected a Hugging Face model directory "
                               f"(save_pretrained layout)")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ParityInputError(f"--model {model_dir}: config.json does not load: {exc}") from None
    archs = list(getattr(config, "architectures", None) or [])
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            archs and not any(a.endswith("ForCausalLM") for a in archs)):
        raise ParityInputError(f"--model {model_dir}: model_type {config.model_type!r} (architectures {archs}) is not "
                               f"a causal language model")
    return config


def read_prompts(source: str | Path) -> list[str]:
    """Prompts from a file (one a line, or a JSON list of strings) or the name of a toy task (its eval split)."""
    from trustscope.train.tasks import get_task, list_tasks

    path = Path(source)
    if path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            prompts = json.loads(text)
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ParityInputError(f"--prompts {source}: a .json file must hold a list of strings")
        else:
            prompts = [line for line in text.splitlines() if line.strip()]
    elif str(source) in list_tasks():
        prompts = [p.prompt for p in get_task(str(source)).split("eval")]
    else:
        raise ParityInputError(f"--prompts {source!r}: neither a file nor a toy task (tasks: {list_tasks()})")
    if not prompts:
        raise ParityInputError(f"--prompts {source}: no prompts")
    return prompts


@dataclass
class ParityResult:
    """Per response token (flat, N rows): sample index, position, token id, engine and trainer log-probs, and on
    an MoE model both routings ``(N, L, k)`` and the agreement per token and per layer."""

    model_dir: str
    engine: str
    engine_dtype: str
    trainer_dtype: str
    sample: np.ndarray
    pos: np.ndarray
    token_id: np.ndarray
    mu: np.ndarray
    pi: np.ndarray
    prompts: list[str]
    prompt_index: list[int]
    responses: list[list[int]]
    token_text: list[str]
    response_text: list[str]
    engine_experts: np.ndarray | None = None
    trainer_experts: np.ndarray | None = None
    routing_agreement: np.ndarray | None = None
    layer_agreement: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def diff(self) -> np.ndarray:
        return self.pi - self.mu

    def within(self, tol: float, first: bool = False) -> float:
        d = np.abs(self.diff if not first else self.diff[self.pos == 0])
        return float((d <= tol).mean()) if d.size else 1.0

    def broken(self, bands: list[Band]) -> list[tuple[Band, float]]:
        """The bands not met, each with the share found."""
        found = [(b, self.within(b.tol, b.first)) for b in bands]
        return [(b, s) for b, s in found if s < b.share]


def _position_bucket(pos: np.ndarray) -> np.ndarray:
    from trustscope.columns import position_bucket

    return position_bucket(pos)


def summary(result: ParityResult, largest: int = 5) -> dict[str, Any]:
    """The report as plain data: tolerance shares, stats by position bucket and for the first token, the largest
    differences with their text, and (MoE) by routing agreement and by layer."""
    d = np.abs(result.diff)
    out: dict[str, Any] = {
        "model": result.model_dir, "engine": result.engine, "engine_dtype": result.engine_dtype,
        "trainer_dtype": result.trainer_dtype, "responses": len(result.responses), "tokens": int(d.size),
        "max_abs": float(d.max()) if d.size else 0.0, "mean_abs": float(d.mean()) if d.size else 0.0,
        "within": {f"{t:g}": result.within(t) for t in DEFAULT_TOLERANCES},
    }
    rows = []
    buckets = _position_bucket(result.pos)
    for b in np.unique(buckets):
        sel = buckets == b
        hi = int(result.pos[sel].max())
        rows.append({"position": f"{int(b)}" if hi == b else f"{int(b)}-{hi}", "tokens": int(sel.sum()),
                     "mean_abs": float(d[sel].mean()), "max_abs": float(d[sel].max()),
                     **{f"within_{t:g}": float((d[sel] <= t).mean()) for t in DEFAULT_TOLERANCES}})
    out["by_position"] = rows
    first = result.pos == 0
    for name, sel in (("first_token", first), ("later_tokens", ~first)):
        out[name] = {"tokens": int(sel.sum()), "mean_abs": float(d[sel].mean()) if sel.any() else None,
                     "max_abs": float(d[sel].max()) if sel.any() else None,
                     "share_of_abs_diff": float(d[sel].sum() / d.sum()) if d.sum() > 0 else None}
    top = []
    for i in np.argsort(-d, kind="stable")[:largest]:
        s = int(result.sample[i])
        resp = result.responses[s]
        pos = int(result.pos[i])
        top.append({"sample": s, "pos": pos, "prompt": result.prompts[result.prompt_index[s]],
                    "before": _decode_prefix(result, s, pos),
                    "token": result.token_text[i], "token_id": int(resp[pos]), "mu": float(result.mu[i]),
                    "pi": float(result.pi[i]), "diff": float(result.diff[i]),
                    **({"routing_agreement": float(result.routing_agreement[i])}
                       if result.routing_agreement is not None else {})})
    out["largest"] = top
    if result.routing_agreement is not None:
        a = result.routing_agreement
        full = a == 1.0
        out["routing"] = {
            "agreement_mean": float(a.mean()),
            "tokens_full_agreement": float(full.mean()),
            "mean_abs_full_agreement": float(d[full].mean()) if full.any() else None,
            "mean_abs_disagreement": float(d[~full].mean()) if (~full).any() else None,
            "share_of_abs_diff_on_disagreement": float(d[~full].sum() / d.sum()) if d.sum() > 0 else None,
            "by_layer": [float(x) for x in result.layer_agreement.mean(0)],
            "by_position": [{"position": r["position"], "agreement": float(a[buckets == b].mean())}
                            for r, b in zip(rows, np.unique(buckets), strict=True)],
        }
    return out


def _decode_prefix(result: ParityResult, sample: int, pos: int) -> str:
    return result.extra["decode"](result.responses[sample][:pos]) if "decode" in result.extra else ""


def format_summary(s: dict[str, Any], bands: list[Band], broken: list[tuple[Band, float]]) -> str:
    """The report as text for the terminal."""
    lines = [f"parity: {s['model']}", f"  engine {s['engine']} ({s['engine_dtype']}) vs trainer forward "
             f"({s['trainer_dtype']}): {s['tokens']:,} tokens in {s['responses']} responses",
             f"  |log pi - log mu|: mean {s['mean_abs']:.3g}, max {s['max_abs']:.3g}",
             "  within " + ", ".join(f"{t}: {v:.2%}" for t, v in s["within"].items())]
    ft, lt = s["first_token"], s["later_tokens"]
    if ft["tokens"]:
        lines.append(f"  first generated token: mean {ft['mean_abs']:.3g}, max {ft['max_abs']:.3g} "
                     f"({ft['share_of_abs_diff']:.1%} of the total |diff| on {ft['tokens']} tokens)"
                     if ft["share_of_abs_diff"] is not None else f"  first generated token: {ft['tokens']} tokens, no "
                     f"difference")
    if lt["tokens"]:
        lines.append(f"  later tokens: mean {lt['mean_abs']:.3g}, max {lt['max_abs']:.3g}")
    lines.append("  by position: " + "; ".join(f"{r['position']}: mean {r['mean_abs']:.2g}, within 1e-2 "
                                               f"{r['within_0.01']:.0%} ({r['tokens']})" for r in s["by_position"]))
    if "routing" in s:
        r = s["routing"]
        lines.append(f"  routing: {r['agreement_mean']:.2%} of (layer, slot) choices agree; "
                     f"{r['tokens_full_agreement']:.1%} of tokens agree in every layer")
        if r["mean_abs_disagreement"] is not None:
            lines.append(f"    mean |diff| with full agreement {r['mean_abs_full_agreement'] or 0:.3g}, with a "
                         f"disagreement {r['mean_abs_disagreement']:.3g} "
                         f"({r['share_of_abs_diff_on_disagreement']:.1%} of the total |diff|)")
        lines.append("    by layer: " + ", ".join(f"{i}: {v:.1%}" for i, v in enumerate(r["by_layer"])))
    lines.append("  largest:")
    for t in s["largest"]:
        lines.append(f"    {t['diff']:+.3g} at pos {t['pos']} of sample {t['sample']}: {t['prompt']!r} + "
                     f"{t['before']!r} -> {t['token']!r} (mu {t['mu']:.4g}, pi {t['pi']:.4g})")
    for b in bands:
        bad = next((share for bb, share in broken if bb == b), None)
        lines.append(f"  band {b}: {'BROKEN' if bad is not None else 'ok'}"
                     + (f" (found {bad:.2%})" if bad is not None else ""))
    return "\n".join(lines)


def run_parity(
    model_dir: str | Path,
    prompts: list[str],
    *,
    engine: str = "vllm",
    engine_dtype: str = "float32",
    trainer_dtype: str = "float32",
    n: int = 1,
    max_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    routing: bool = True,
) -> ParityResult:
    """Sample with the engine, score with the trainer's forward, and (MoE, ``routing``) take both routings."""
    import torch

    from trustscope.engines import DTYPES, make_engine
    from trustscope.engines.base import request_seeds
    from trustscope.routing import TrainerRouting, VLLMRouting, agreement, moe_shape

    config = check_causal_lm(model_dir)
    for name, value in (("engine_dtype", engine_dtype), ("trainer_dtype", trainer_dtype)):
        if value not in DTYPES:
            raise ParityInputError(f"{name} must be one of {list(DTYPES)}, got {value!r}")
    shape = moe_shape(config) if routing else None
    kw: dict[str, Any] = {}
    if shape is not None and engine == "vllm":
        kw["llm_kwargs"] = {"enable_prefix_caching": False}  # every request's prompt goes through the routers
    elif shape is not None:
        kw["routing"] = True  # the transformers engine's router hooks during generate
    eng = make_engine(engine, model_dir, dtype=engine_dtype, seed=seed, **kw)
    try:
        capture = VLLMRouting(eng.llm, shape) if shape is not None and engine == "vllm" else None
        if capture is None:
            rollout = eng.generate(list(prompts), n=n, max_tokens=max_tokens, temperature=temperature, topk=1,
                                   seed=seed)
            engine_rows = None if rollout.routed_experts is None else [  # from the last prompt position on
                rows[len(ids) - 1:] for rows, ids in zip(rollout.routed_experts, rollout.prompt_ids, strict=True)]
        else:  # one request at a time: each forward pass holds that request's rows only
            parts, engine_rows = [], []
            seeds = iter(request_seeds(seed, len(prompts) * n))
            for prompt in prompts:
                for _ in range(n):
                    capture.reset()
                    part = eng.generate([prompt], n=1, max_tokens=max_tokens, temperature=temperature, topk=1,
                                        seed=next(seeds))
                    rows = capture.take()  # (P + T - 1, L, k): the prompt's prefill, then one row per decode
                    p, t = len(part.prompt_ids[0]), len(part.response_ids[0])
                    if len(rows) != p + t - 1:
                        raise RuntimeError(f"vLLM routed {len(rows)} rows for a {p}-token prompt and {t}-token "
                                           f"response; expected {p + t - 1}")
                    engine_rows.append(rows[p - 1:])
                    parts.append(part)
            rollout = _concat(parts, prompts)
    finally:
        eng.close()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[trainer_dtype]).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tensors = rollout.to_tensors(pad_id=pad)
    p, t = tensors.prompt_len, tensors.response_ids.shape[1]
    tracker = TrainerRouting(model) if shape is not None else None
    with torch.no_grad(), (tracker.hooked() if tracker else _nothing()):
        logits = model(input_ids=tensors.input_ids, attention_mask=tensors.attention_mask,
                       position_ids=tensors.position_ids).logits[:, p - 1: p + t - 1]  # (B, T, V)
    lp = (logits.float() / temperature).log_softmax(-1).gather(-1, tensors.response_ids[..., None])[..., 0]  # (B, T)
    mask = tensors.mask.numpy()
    b_idx, pos = np.nonzero(mask)
    result = ParityResult(
        model_dir=str(model_dir), engine=engine, engine_dtype=engine_dtype, trainer_dtype=trainer_dtype,
        sample=b_idx, pos=pos.astype(np.int32), token_id=tensors.response_ids.numpy()[mask],
        mu=tensors.mu_logprob.numpy()[mask].astype(np.float64), pi=lp.numpy()[mask].astype(np.float64),
        prompts=list(rollout.prompts), prompt_index=list(rollout.prompt_index), responses=rollout.response_ids,
        token_text=[tokenizer.decode([int(x)]) for x in tensors.response_ids.numpy()[mask]],
        response_text=list(rollout.texts),
        extra={"decode": lambda ids: tokenizer.decode(ids), "sampling": rollout.sampling, "routing_shape": shape},
    )
    if tracker is not None:
        trainer_all = tracker.take(*tensors.input_ids.shape)[:, p - 1: p + t - 1]  # (B, T, L, k)
        result.trainer_experts = trainer_all[mask]
        if engine_rows is not None:
            result.engine_experts = np.concatenate(engine_rows).astype(np.int16)
            result.routing_agreement, result.layer_agreement = agreement(result.engine_experts,
                                                                         result.trainer_experts)
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _concat(parts: list[Any], prompts: list[str]) -> Any:
    """One Rollout from one-request Rollouts, in the order generated (grouped by prompt)."""
    from trustscope.engines import Rollout

    first = parts[0]
    index = {p: i for i, p in enumerate(prompts)}
    return Rollout(
        prompts=list(prompts), n=len(parts) // len(prompts), topk=first.topk,
        prompt_index=[index[r.prompts[0]] for r in parts],
        **{name: [x for r in parts for x in getattr(r, name)] for name in (
            "prompt_ids", "response_ids", "mu_logprobs", "mu_topk_ids", "mu_topk_logprobs", "finish_reasons",
            "texts")},
        sampling=first.sampling,
    )


def log_parity(result: ParityResult, logdir: str | Path, run_id: str | None = None) -> str:
    """Write the tokens as one step of a trustscope run (mu = engine, pi = pi_old = trainer); return its run id."""
    from trustscope.logger import TokenLogger

    tokens: dict[str, Any] = {
        "token_id": [], "mu_logprob": [], "pi_logprob": [], "old_logprob": [],
    }
    with_routing = result.routing_agreement is not None
    if with_routing:
        tokens |= {"engine_experts": [], "trainer_experts": []}
    for s in range(len(result.responses)):
        sel = result.sample == s
        tokens["token_id"].append(result.token_id[sel])
        tokens["mu_logprob"].append(result.mu[sel].astype(np.float32))
        tokens["pi_logprob"].append(result.pi[sel].astype(np.float32))
        tokens["old_logprob"].append(result.pi[sel].astype(np.float32))
        if with_routing:  # the logger checks both against routing_shape and fills routing_agreement
            tokens["engine_experts"].append(result.engine_experts[sel])
            tokens["trainer_experts"].append(result.trainer_experts[sel])
    sampling = {k: v for k, v in result.extra.get("sampling", {}).items() if isinstance(v, str | int | float | bool)}
    with TokenLogger(logdir, run_id, model=result.model_dir, sampling=sampling,
                     tokenizer=result.model_dir, routing_shape=result.extra.get("routing_shape"),
                     config={"parity": {
                         "engine": result.engine, "engine_dtype": result.engine_dtype,
                         "trainer_dtype": result.trainer_dtype}}) as logger:
        b = len(result.responses)
        logger.log_step(0, tokens=tokens, samples={
            "prompt_id": np.asarray(result.prompt_index, dtype=np.int64),
            "prompt": [result.prompts[i] for i in result.prompt_index], "response": result.response_text,
            "advantage": np.zeros(b, dtype=np.float32), "reward": np.zeros(b, dtype=np.float32),
            "length": np.asarray([len(r) for r in result.responses], dtype=np.int32)})
        return logger.run_id
