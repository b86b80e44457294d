"""``trustscope parity``: the same token sequences through the rollout engine and the trainer's forward at the
same weights, before a run starts, with tolerance bands on the log-prob differences.

The engine (vLLM, or transformers ``generate``) samples responses to the prompts at its dtype; the trainer's forward
(transformers, at the trainer's dtype) scores the same tokens, teacher-forced. Each response token's difference
``d = log pi - log mu`` (trainer minus engine) is reported: the share of tokens with ``|d|`` within 1e-3, 1e-2 and
0.1, the largest with their text, by position bucket, the first generated token apart (where most of the
discrepancy of a prefill/decode split shows), and on a mixture-of-experts model by routing agreement (see
:mod:`trustscope.routing`). A band ``TOL=SHARE`` (at least SHARE of the tokens within TOL) that is broken makes
the command exit 1, so it runs in CI before a run starts.

Beside the sampled token, the **full distributions** are compared at the same histories: the engine's raw logits are
kept at up to ``full_positions`` generated positions (a wrapper on the in-process vLLM model's ``compute_logits``,
or a hook on the transformers engine's output head), the trainer's at the same positions, and the total variation
``0.5 * sum |mu - pi|`` and ``KL(mu || pi)`` are taken over the whole vocabulary (both at the sampling
temperature). The engine's context (``max_model_len``) comes from the prompts, ``max_tokens`` and the model's
``max_position_embeddings``, so responses of thousands of tokens run as they would in training; the trainer's
forward runs at its dtype and attention implementation (``attn_implementation``), its output head in chunks of
positions so no ``(B, T, V)`` tensor is made.

The tokens are logged as a trustscope run (mu = the engine, pi = pi_old = the trainer, advantage 0), so every page
and ``trustscope doctor`` read it; on an MoE model each token carries its ``routing_agreement``; the full-distribution
figures go into its manifest (``config.parity.full_distribution``), which ``trustscope explain`` cites beside its
numerics share.
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
FULL_POSITIONS = 256
"""Generated positions at most where the full distributions are compared (spread evenly over the responses'
positions, the first generated token always among them): a position costs ``V`` floats a side."""
HEAD_CHUNK = 512
"""Positions per chunk of the trainer's output head (``HEAD_CHUNK x V`` float32 at a time)."""


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
    full: dict[str, np.ndarray] | None = None
    """The full-distribution comparison at the kept positions: ``sample``, ``pos``, ``tv`` and ``kl`` (mu || pi)
    arrays; None where it was not taken (``full_skipped`` in ``extra`` says why)."""
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
    out["full_distribution"] = full_summary(result)
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


def full_summary(result: ParityResult) -> dict[str, Any]:
    """The full-distribution comparison as plain data: positions, TV and KL (mean, median, p99, max), the first
    generated token apart, by position bucket; or ``{"skipped": why}``."""
    f = result.full
    if f is None or not len(f["tv"]):
        return {"skipped": result.extra.get("full_skipped", "no position kept")}

    def stats(sel: np.ndarray) -> dict[str, Any]:
        tv, kl = f["tv"][sel], f["kl"][sel]
        return {"positions": int(sel.sum()), "tv_mean": float(tv.mean()), "tv_median": float(np.median(tv)),
                "tv_p99": float(np.percentile(tv, 99)), "tv_max": float(tv.max()), "kl_mean": float(kl.mean()),
                "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}

    out = stats(np.ones(len(f["tv"]), dtype=bool))
    if "sampled_gap" in f:  # the kept rows score the sampled token as the engine's mu did (else misaligned)
        out["sampled_gap_max"] = float(f["sampled_gap"].max())
    first = f["pos"] == 0
    out["first_token"] = stats(first) if first.any() else None
    buckets = _position_bucket(f["pos"])
    out["by_position"] = [{"position": int(b), **stats(buckets == b)} for b in np.unique(buckets)]
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
    f = s.get("full_distribution") or {}
    if "skipped" in f:
        lines.append(f"  full distributions: not compared ({f['skipped']})")
    elif f:
        lines.append(f"  full distributions at {f['positions']:,} positions (TV and KL(mu || pi) over the whole "
                     f"vocabulary): TV mean {f['tv_mean']:.3g}, p99 {f['tv_p99']:.3g}, max {f['tv_max']:.3g}; KL "
                     f"mean {f['kl_mean']:.3g}, max {f['kl_max']:.3g}")
        if f.get("sampled_gap_max", 0) > 1e-2:
            lines.append(f"    the engine's kept rows score the sampled token up to {f['sampled_gap_max']:.3g} nats "
                         f"from its reported mu: the rows may not be the distributions it sampled from")
        if f["first_token"]:
            lines.append(f"    first generated token: TV mean {f['first_token']['tv_mean']:.3g}, KL mean "
                         f"{f['first_token']['kl_mean']:.3g} ({f['first_token']['positions']} positions)")
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
    full_positions: int = FULL_POSITIONS,
    attn_implementation: str | None = None,
    max_model_len: int | None = None,
) -> ParityResult:
    """Sample with the engine, score with the trainer's forward, compare the full distributions at up to
    ``full_positions`` positions (0: not), and (MoE, ``routing``) take both routings. ``attn_implementation``: the
    trainer forward's (transformers' ``attn_implementation``; None: its default). ``max_model_len``: the vLLM
    engine's context (None: the longest prompt plus ``max_tokens``, within the model's
    ``max_position_embeddings``)."""
    import torch

    from trustscope.engines import DTYPES, make_engine
    from trustscope.engines.base import request_seeds
    from trustscope.routing import TrainerRouting, VLLMRouting, agreement, moe_shape

    config = check_causal_lm(model_dir)
    for name, value in (("engine_dtype", engine_dtype), ("trainer_dtype", trainer_dtype)):
        if value not in DTYPES:
            raise ParityInputError(f"{name} must be one of {list(DTYPES)}, got {value!r}")
    if full_positions < 0:
        raise ParityInputError(f"full_positions must be >= 0, got {full_positions}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    shape = moe_shape(config) if routing else None
    kw: dict[str, Any] = {}
    if engine == "vllm":
        kw["max_model_len"] = max_model_len or context_length(config, tokenizer, prompts, max_tokens)
    if shape is not None and engine == "vllm":
        kw["llm_kwargs"] = {"enable_prefix_caching": False}  # every request's prompt goes through the routers
    elif shape is not None:
        kw["routing"] = True  # the transformers engine's router hooks during generate
    positions = spread_positions(max_tokens, len(prompts) * n, full_positions)
    eng = make_engine(engine, model_dir, dtype=engine_dtype, seed=seed, **kw)
    skipped = None
    try:
        capture = VLLMRouting(eng.llm, shape) if shape is not None and engine == "vllm" else None
        logits_capture = None
        if positions:
            try:
                logits_capture = EngineLogits(eng, positions)
            except EngineLogitsUnavailable as exc:
                skipped = str(exc)
        one_at_a_time = engine == "vllm" and (capture is not None or logits_capture is not None)
        if not one_at_a_time:
            if logits_capture is not None:
                logits_capture.reset()
            rollout = eng.generate(list(prompts), n=n, max_tokens=max_tokens, temperature=temperature, topk=1,
                                   seed=seed)
            engine_rows = None if rollout.routed_experts is None else [  # from the last prompt position on
                rows[len(ids) - 1:] for rows, ids in zip(rollout.routed_experts, rollout.prompt_ids, strict=True)]
            engine_logits = None if logits_capture is None else logits_capture.take_batch(
                [len(r) for r in rollout.response_ids])
        else:  # one request at a time: each forward pass holds that request's rows only
            parts, engine_rows, engine_logits = [], [] if capture is not None else None, {}
            seeds = iter(request_seeds(seed, len(prompts) * n))
            for prompt in prompts:
                for _ in range(n):
                    if capture is not None:
                        capture.reset()
                    if logits_capture is not None:
                        logits_capture.reset()
                    part = eng.generate([prompt], n=1, max_tokens=max_tokens, temperature=temperature, topk=1,
                                        seed=next(seeds))
                    p, t = len(part.prompt_ids[0]), len(part.response_ids[0])
                    if capture is not None:
                        rows = capture.take()  # (P + T - 1, L, k): the prompt's prefill, then one row per decode
                        if len(rows) != p + t - 1:
                            raise RuntimeError(f"vLLM routed {len(rows)} rows for a {p}-token prompt and {t}-token "
                                               f"response; expected {p + t - 1}")
                        engine_rows.append(rows[p - 1:])
                    if logits_capture is not None:
                        engine_logits |= {(len(parts), pos): row for pos, row in logits_capture.take(t).items()}
                    parts.append(part)
            rollout = _concat(parts, prompts)
    finally:
        eng.close()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=DTYPES[trainer_dtype],
        **({"attn_implementation": attn_implementation} if attn_implementation else {})).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tensors = rollout.to_tensors(pad_id=pad)
    p, t = tensors.prompt_len, tensors.response_ids.shape[1]
    tracker = TrainerRouting(model) if shape is not None else None
    wanted = set() if not engine_logits else set(engine_logits)
    with torch.no_grad(), (tracker.hooked() if tracker else _nothing()):
        lp, trainer_rows = trainer_logprobs(model, tensors, temperature, wanted)  # (B, T), {(b, pos): (V,)}
    mask = tensors.mask.numpy()
    b_idx, pos = np.nonzero(mask)
    result = ParityResult(
        model_dir=str(model_dir), engine=engine, engine_dtype=engine_dtype, trainer_dtype=trainer_dtype,
        sample=b_idx, pos=pos.astype(np.int32), token_id=tensors.response_ids.numpy()[mask],
        mu=tensors.mu_logprob.numpy()[mask].astype(np.float64), pi=lp[mask].astype(np.float64),
        prompts=list(rollout.prompts), prompt_index=list(rollout.prompt_index), responses=rollout.response_ids,
        token_text=[tokenizer.decode([int(x)]) for x in tensors.response_ids.numpy()[mask]],
        response_text=list(rollout.texts),
        extra={"decode": lambda ids: tokenizer.decode(ids), "sampling": rollout.sampling, "routing_shape": shape,
               "attn_implementation": getattr(model.config, "_attn_implementation", attn_implementation),
               "max_model_len": kw.get("max_model_len"),
               **({"full_skipped": skipped} if skipped else {"full_skipped": "full_positions=0"}
                  if not positions else {})},
    )
    if engine_logits:
        result.full = full_distribution(engine_logits, trainer_rows, temperature)
        # the captured rows' own log-prob of the sampled token against mu: a capture one position off shows here
        mu_at = {(int(s_), int(q)): m for s_, q, m in zip(result.sample, result.pos, result.mu, strict=True)}
        ids_at = {(int(s_), int(q)): int(i) for s_, q, i in zip(result.sample, result.pos, result.token_id, strict=True)}
        keys = list(zip(result.full["sample"].tolist(), result.full["pos"].tolist(), strict=True))
        result.full["sampled_gap"] = np.asarray(
            [abs(float((engine_logits[k].float() / temperature).log_softmax(-1)[ids_at[k]]) - mu_at[k])
             for k in keys], dtype=np.float64)
    if tracker is not None:
        trainer_all = tracker.take(*tensors.input_ids.shape)[:, p - 1: p + t - 1]  # (B, T, L, k)
        result.trainer_experts = trainer_all[mask]
        if engine_rows is not None:
            result.engine_experts = np.concatenate(engine_rows).astype(np.int16)
            result.routing_agreement, result.layer_agreement = agreement(result.engine_experts,
                                                                         result.trainer_experts)
    return result


def context_length(config: Any, tokenizer: Any, prompts: list[str], max_tokens: int) -> int:
    """The engine's context for these prompts: the longest prompt's tokens plus ``max_tokens`` (at least 64), within
    the model's ``max_position_embeddings``; ParityInputError when the model cannot hold it."""
    longest = max(len(tokenizer(p)["input_ids"]) for p in prompts)
    need = max(64, longest + max_tokens)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and longest + max_tokens > limit:
        raise ParityInputError(f"--max-tokens {max_tokens}: a {longest}-token prompt plus {max_tokens} tokens exceeds "
                               f"the model's max_position_embeddings={limit}")
    return min(need, limit) if limit is not None else need


def spread_positions(max_tokens: int, responses: int, budget: int) -> frozenset[int]:
    """The generated positions whose full distributions are kept: at most ``budget`` rows over ``responses``
    responses of up to ``max_tokens`` tokens, evenly spread, position 0 (the first generated token) always."""
    if budget <= 0:
        return frozenset()
    per_response = max(1, budget // max(responses, 1))
    stride = max(1, math.ceil(max_tokens / per_response))
    return frozenset(range(0, max_tokens, stride))


class EngineLogitsUnavailable(RuntimeError):
    """The engine's logits cannot be read here (an out-of-process vLLM engine): the comparison is skipped."""


class EngineLogits:
    """The engine's raw logits at the kept generated positions, one generate call at a time.

    vLLM (in-process only: its CPU engine, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``compute_logits`` of the
    worker's model wrapped; with one request in flight, its n-th call scores the n-th generated token (the prefill's
    last position, then one decode step a call). transformers: a forward hook on the engine model's output head,
    whose n-th call's last position scores every row's n-th token."""

    def __init__(self, engine: Any, positions: frozenset[int]) -> None:
        import torch

        self.positions = positions
        self.rows: list[tuple[int, torch.Tensor]] = []
        self.calls = 0

        def keep(out: torch.Tensor) -> None:
            if self.calls in self.positions:
                last = out[:, -1] if out.dim() == 3 else out  # (rows, V)
                self.rows.append((self.calls, last.detach().to("cpu", torch.float32).clone()))
            self.calls += 1

        if engine.name == "vllm":
            if not getattr(engine, "in_process", False):
                raise EngineLogitsUnavailable("the vLLM engine runs out of process (set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                                              "to read its logits)")

            def bind(worker: Any) -> int:
                model = worker.model_runner.model
                original = model.compute_logits

                def compute_logits(*args: Any, **kwargs: Any) -> Any:
                    out = original(*args, **kwargs)
                    if out is not None:
                        keep(out)
                    return out

                model.compute_logits = compute_logits
                return 1

            engine.llm.collective_rpc(bind)
        else:
            engine.model.get_output_embeddings().register_forward_hook(lambda module, args, out: keep(out))

    def reset(self) -> None:
        self.rows, self.calls = [], 0

    def take(self, length: int) -> dict[int, Any]:
        """One request's rows: position -> ``(V,)`` logits, positions below its ``length`` only."""
        out = {pos: row[-1] for pos, row in self.rows if pos < length}
        self.reset()
        return out

    def take_batch(self, lengths: list[int]) -> dict[tuple[int, int], Any]:
        """A batched generate's rows: ``(sample, position) -> (V,)`` logits, each sample's own positions only."""
        out = {(b, pos): row[b] for pos, row in self.rows for b in range(len(lengths))
               if b < len(row) and pos < lengths[b]}
        self.reset()
        return out


def trainer_logprobs(model: Any, tensors: Any, temperature: float, wanted: set[tuple[int, int]],
                     chunk: int = HEAD_CHUNK) -> tuple[np.ndarray, dict[tuple[int, int], Any]]:
    """The trainer's log-prob of each response token ``(B, T)`` and, at the ``wanted`` ``(sample, position)`` pairs,
    its whole logits row (float32, before the temperature): the backbone once, then the output head over :data:`HEAD_CHUNK` positions at a time (a
    ``(B, T, V)`` tensor at V = 151,936 and thousands of tokens would not fit)."""
    import torch

    p, t = tensors.prompt_len, tensors.response_ids.shape[1]
    hidden = model.get_decoder()(input_ids=tensors.input_ids, attention_mask=tensors.attention_mask,
                                 position_ids=tensors.position_ids).last_hidden_state[:, p - 1: p + t - 1]  # (B, T, H)
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    b = hidden.shape[0]
    flat, ids = hidden.reshape(b * t, -1), tensors.response_ids.reshape(-1)  # (B T, H), (B T,)
    out = torch.empty(b * t, dtype=torch.float32)
    rows: dict[tuple[int, int], Any] = {}
    for lo in range(0, b * t, chunk):
        z = head(flat[lo: lo + chunk]).float()  # (c, V)
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        lp = (z / temperature).log_softmax(-1)
        out[lo: lo + chunk] = lp.gather(-1, ids[lo: lo + chunk, None])[:, 0]
        for i in range(lo, min(lo + chunk, b * t)):
            if (i // t, i % t) in wanted:
                rows[(i // t, i % t)] = z[i - lo].clone()  # the logits: log-softmaxed in float64 when compared
    return out.reshape(b, t).numpy(), rows


def full_distribution(engine: dict[tuple[int, int], Any], trainer: dict[tuple[int, int], Any],
                      temperature: float) -> dict[str, np.ndarray]:
    """Per kept position: the total variation ``0.5 * sum |mu - pi|`` and ``KL(mu || pi)`` over the whole
    vocabulary (the vocabularies cut to the shorter, vLLM's padding), both sides' logits at the sampling
    temperature, log-softmaxed in float64 (float32 sums over 151,936 entries err by about 1e-6, the size of a
    close pair's KL)."""
    keys = sorted(k for k in engine if k in trainer)
    tv, kl = [], []
    for key in keys:
        width = min(len(engine[key]), len(trainer[key]))
        mu_lp = (engine[key][:width].double() / temperature).log_softmax(-1)
        pi_lp = (trainer[key][:width].double() / temperature).log_softmax(-1)
        mu_p = mu_lp.exp()
        tv.append(float(0.5 * (mu_p - pi_lp.exp()).abs().sum()))
        kl.append(float((mu_p * (mu_lp - pi_lp)).sum()))
    return {"sample": np.asarray([k[0] for k in keys], dtype=np.int64),
            "pos": np.asarray([k[1] for k in keys], dtype=np.int32),
            "tv": np.asarray(tv, dtype=np.float64), "kl": np.asarray(kl, dtype=np.float64)}


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
                         "trainer_dtype": result.trainer_dtype,
                         "attn_implementation": result.extra.get("attn_implementation"),
                         "max_model_len": result.extra.get("max_model_len"),
                         "tokens": int(result.diff.size),
                         "mean_abs_log_ratio": float(np.abs(result.diff).mean()) if result.diff.size else 0.0,
                         "full_distribution": {k: v for k, v in full_summary(result).items()
                                               if k not in ("by_position", "first_token")}}}) as logger:
        b = len(result.responses)
        logger.log_step(0, tokens=tokens, samples={
            "prompt_id": np.asarray(result.prompt_index, dtype=np.int64),
            "prompt": [result.prompts[i] for i in result.prompt_index], "response": result.response_text,
            "advantage": np.zeros(b, dtype=np.float32), "reward": np.zeros(b, dtype=np.float32),
            "length": np.asarray([len(r) for r in result.responses], dtype=np.int32)})
        return logger.run_id
