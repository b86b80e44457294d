"""Log a run of TRL's ``GRPOTrainer`` with trustscope: two lines of user code.

    from trustscope.integrations.trl import attach
    attach(trainer, "logs")        # after building the trainer, before trainer.train()
    trainer.train()

Written and tested against TRL 1.16.0 (the ``[trl]`` extra pins it). Per optimizer step (``step`` is TRL's
``state.global_step`` before the update; micro-batches of one step share it) and per rank it logs:

- **tokens**: the completion tokens TRL's loss covers, ``completion_mask * tool_mask`` (padding and tool results are
  left out; ``pos`` is the column in TRL's completion tensor), each with
  - ``mu_logprob``: the engine's log-prob of the sampled token when TRL has one (vLLM's ``sampling_per_token_logps``,
    or a ``rollout_func``'s ``logprobs``): ``mu_source = "engine"``. TRL's transformers path keeps none; mu is then
    TRL's ``old_per_token_logps`` (the trainer's recompute at the rollout's weights) when TRL computed them, else pi
    itself, and ``run.json`` records ``mu_source = "trainer_recompute"``: mismatch (mu against pi_old) reads zero
    there, and attach warns. Tokens whose mu or pi is NaN (vLLM could not score them) are left out of the log and
    counted in the ``trustscope/unscored_tokens`` scalar; training is never interrupted for them.
  - ``pi_logprob`` and ``entropy``: from the loss's own forward (TRL's fused LM head, at TRL's temperature); no
    second forward is run for them.
  - ``old_logprob``: TRL's ``old_per_token_logps`` when it computed them; ``advantage``: TRL's.
  - ``kept``: the mask TRL's loss applied, from its settings (:func:`trl_kept`: the clip region of ``epsilon_low``
    / ``epsilon_high`` / ``delta`` for the clipped loss types, and the off-policy, high-entropy and vLLM
    importance-sampling masks when they are on). Tokens with A = 0 are kept, as TRL counts them, so
    ``1 - mean(kept)`` over a step's tokens is TRL's ``clip_ratio/region_mean`` when only the clip is on (and one
    micro-batch makes the step: with gradient accumulation TRL averages the micro-batches' ratios).
- **samples**: a sample id stable over the iterations that reuse a rollout, the prompt group, TRL's weighted reward
  (``sum_i w_i r_i``, the figure TRL logs as ``reward``), the sequence's advantage, prompt and completion text and
  finish reason (``stop`` when the completion ends in an EOS token, else ``length``).
- **steps**: every number TRL logs, as ``trl/<name>``, at the step it describes.
- **run.json**: TRL's loss and sampling settings (``config["trl"]``, :func:`trl_settings`), ``loss_rule =
  "trl:<loss_type>"``, ``mu_source``, ``source = {"framework": "trl", "version": trl.__version__}``, the sampler's
  temperature under ``sampling``.

Top-K (``topk=K``). On the vLLM path attach asks the engine for K log-probs per token (``VLLMGeneration.logprobs``)
and keeps their ids, handing TRL the sampled token's log-prob first as it expects. On the transformers path there
is no engine distribution, so ``topk=K`` needs ``topk_forward=True``: one extra no-grad forward right after each
rollout gives the trainer's own top-K at the rollout's weights; it stands in for mu's top-K (a recompute, like mu
on that path: top-K TV measures how far pi moved since the rollout, not training-inference mismatch). Either way
pi's log-probs at those ids come from the loss's own forward, though TRL's fused LM head makes no logits: a forward
hook on the model's backbone keeps its last hidden states (the head's input), and
:func:`~trustscope.capture.logprobs_from_hidden` scores the K ids with the head's K rows and the log-normaliser
recovered from TRL's log-prob of the sampled token (``log Z = z_token - log pi(token)``): ``O(B T K H)`` work, no
further forward, no ``(B, T, V)`` tensor. Without ``topk`` nothing is recomputed.

How it hooks in. TRL's callbacks mark step boundaries (used for the scalars and to close the log) but no public
hook sees a batch's tokens or the loss's log-probs, so :class:`_Hooks` wraps four methods of this one trainer
instance (never the class), and for top-K on vLLM its engine's ``generate``; each wrapper calls TRL's method
unchanged and reads its inputs or outputs (only the engine's log-prob lists are reordered). attach first
checks that every method, parameter and attribute this relies on exists (:func:`check_trainer`) and raises
:class:`TRLVersionError` naming the TRL version and what is missing; tests/test_integration_trl.py pins the logged
values against TRL's own, so a TRL upgrade that changes them fails in CI rather than in a user's run.

``RLOOTrainer`` does not share this code path in TRL 1.16 (its loss is sequence-level on ``old_logps`` and it keeps
no per-token rollout log-probs), so attach refuses it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trustscope.extras import missing, release_position

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [trl] extra brings torch and trl
    missing(exc, "trustscope.integrations.trl", extra="trl")

from trustscope.alerts import Alerts
from trustscope.capture import fused_head_forward, logprobs_from_hidden, top_k_from_hidden
from trustscope.columns import turns_from_mask
from trustscope.divergence import force_sampled_into_topk
from trustscope.integrations.wiring import WarningWiring
from trustscope.logger import LogWarning, TokenLogger
from trustscope.trackers import StepReporter

TESTED_TRL = "1.16.0"
"""The newest TRL release this module is tested with (the main test environment's)."""
SUPPORTED_TRL = ">=1.10,<1.17"
"""The TRL releases this module supports (the ``[trl]`` extra's range; docs/trl.md has the table). Within it each
internal is probed (:func:`check_trainer`), never the version string: TRL 1.15 added the fused LM head and
``eos_token_ids``, which older releases lack and this module does without."""

CLIPPED_LOSS_TYPES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo"})
"""TRL loss types whose loss is PPO's clipped surrogate: their mask is the clip region."""
UNMASKED_LOSS_TYPES = frozenset({"cispo", "sapo", "vespo"})
"""TRL loss types that weight tokens (truncated or soft IS weights) but block none."""

_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep",
                                           "compute_entropy"),
    "compute_loss": ("model", "inputs"),
    "get_off_policy_mask": ("advantages", "per_token_logps", "sampling_per_token_logps", "mask",
                            "off_policy_threshold"),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "log": ("logs",),
}
"""GRPOTrainer methods attach wraps or calls, with the parameters it relies on."""
_ATTRIBUTES = ("loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level", "temperature", "top_p",
               "top_k", "min_p", "repetition_penalty", "max_completion_length", "top_entropy_quantile",
               "off_policy_mask_threshold", "use_vllm", "vllm_importance_sampling_correction", "num_generations",
               "reward_weights", "beta", "rollout_func", "tools", "accelerator",
               "processing_class", "state", "args", "model", "_step")
"""GRPOTrainer attributes attach reads."""
_CONFIG_FIELDS = ("delta", "num_iterations", "steps_per_generation", "gradient_accumulation_steps",
                  "per_device_train_batch_size", "scale_rewards", "mask_truncated_completions",
                  "multi_objective_aggregation", "learning_rate")
"""GRPOConfig fields attach reads."""

# Keys attach adds to TRL's batch dict; TRL shuffles and splits them with the rest (they are (B, ...) tensors).
_SAMPLE_ID, _PROMPT_ID, _REWARD = "trustscope_sample_id", "trustscope_prompt_id", "trustscope_reward"
_ENGINE_IDS = "trustscope_engine_ids"
_TOPK_IDS, _TOPK_LOGPROBS, _MU_RECOMPUTE = "trustscope_mu_topk_ids", "trustscope_mu_topk_logprobs", "trustscope_mu"
_POLICY_VERSION = "trustscope_policy_version"


class TRLVersionError(RuntimeError):
    """The installed TRL lacks an internal this integration reads (it supports :data:`SUPPORTED_TRL`)."""


def check_trainer(trainer: Any) -> None:
    """Raise if ``trainer`` is not a ``GRPOTrainer`` with the internals this module reads (TRL 1.10 to 1.16 have them).

    :class:`TRLVersionError` names the installed TRL version and every missing method, parameter or attribute;
    a ``TypeError`` names a trainer class attach does not support. A TRL release outside :data:`SUPPORTED_TRL`
    that has everything only warns.
    """
    import trl
    from trl import GRPOTrainer

    version = trl.__version__
    if not isinstance(trainer, GRPOTrainer):
        hint = (" RLOOTrainer's loss is sequence-level and it keeps no per-token rollout log-probs, so it does not "
                "share GRPOTrainer's code path." if type(trainer).__name__ == "RLOOTrainer" else "")
        raise TypeError(f"trustscope.integrations.trl.attach supports trl.GRPOTrainer (and subclasses), got "
                        f"{type(trainer).__name__}.{hint}")
    missing = []
    for name, params in _METHODS.items():
        method = getattr(trainer, name, None)
        if not callable(method):
            missing.append(f"GRPOTrainer.{name}()")
            continue
        have = inspect.signature(method).parameters
        # TRL 1.14 takes (model, *args, **kwargs) and hands them on: its return value is checked at the first step
        forwards = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in have.values())
        lost = [] if forwards else [p for p in params if p not in have]
        if lost:
            missing.append(f"parameter(s) {', '.join(lost)} of GRPOTrainer.{name}()")
    missing += [f"GRPOTrainer.{name}" for name in _ATTRIBUTES if not hasattr(trainer, name)]
    if hasattr(trainer, "args"):
        missing += [f"GRPOConfig.{name}" for name in _CONFIG_FIELDS if not hasattr(trainer.args, name)]
    if getattr(trainer, "use_vllm", False):
        engine = getattr(trainer, "vllm_generation", None)
        if not callable(getattr(engine, "generate", None)) or not hasattr(engine, "logprobs"):
            missing.append("GRPOTrainer.vllm_generation.generate() / .logprobs")
    if missing:
        raise TRLVersionError(
            f"trustscope.integrations.trl supports TRL {SUPPORTED_TRL}; the installed TRL {version} "
            f"lacks {'; '.join(missing)}. Install a TRL of that range (pip install 'trustscope[trl]'), or log with "
            f"trustscope.logger.TokenLogger from your own code.")
    known = CLIPPED_LOSS_TYPES | UNMASKED_LOSS_TYPES
    if trainer.loss_type not in known:
        raise TRLVersionError(f"GRPOTrainer.loss_type {trainer.loss_type!r} (TRL {version}) is not one whose mask "
                              f"trustscope knows; known: {sorted(known)}")
    position = release_position(version, SUPPORTED_TRL)
    if position < 0:  # TRL 1.0-1.9 return (logps, entropies) from the loss's forward
        raise TRLVersionError(f"trustscope.integrations.trl supports TRL {SUPPORTED_TRL}; the installed TRL {version} "
                              f"is older: pip install 'trustscope[trl]' (or 'trl{SUPPORTED_TRL}')")
    if position > 0:
        warnings.warn(f"trustscope.integrations.trl supports TRL {SUPPORTED_TRL}, this is TRL {version}; the "
                      f"internals it reads are present, but check the log against TRL's own metrics",
                      LogWarning, stacklevel=3)


def trl_settings(trainer: Any) -> dict[str, Any]:
    """TRL's loss and sampling settings as plain values, for ``run.json`` (``config["trl"]``)."""
    args = trainer.args
    return {
        "trainer": type(trainer).__name__,
        "loss_type": trainer.loss_type,
        "epsilon_low": float(trainer.epsilon_low),
        "epsilon_high": float(trainer.epsilon_high),
        "delta": None if args.delta is None else float(args.delta),
        "beta": float(trainer.beta),
        "importance_sampling_level": trainer.importance_sampling_level,
        "top_entropy_quantile": float(trainer.top_entropy_quantile),
        "off_policy_mask_threshold": trainer.off_policy_mask_threshold,
        "use_vllm": bool(trainer.use_vllm),
        "vllm_mode": getattr(args, "vllm_mode", None) if trainer.use_vllm else None,
        "vllm_importance_sampling_correction": bool(trainer.vllm_importance_sampling_correction),
        "vllm_importance_sampling_mode": getattr(trainer, "vllm_importance_sampling_mode", None),
        "vllm_importance_sampling_clip_min": getattr(trainer, "vllm_importance_sampling_clip_min", None),
        "vllm_importance_sampling_clip_max": getattr(trainer, "vllm_importance_sampling_clip_max", None),
        "num_generations": int(trainer.num_generations),
        "num_iterations": int(args.num_iterations),
        "steps_per_generation": int(args.steps_per_generation),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "scale_rewards": args.scale_rewards,
        "multi_objective_aggregation": args.multi_objective_aggregation,
        "mask_truncated_completions": bool(args.mask_truncated_completions),
        "reward_weights": [float(w) for w in trainer.reward_weights.tolist()],
        "learning_rate": float(args.learning_rate),
        "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p),
        "top_k": None if trainer.top_k is None else int(trainer.top_k),
        "min_p": None if trainer.min_p is None else float(trainer.min_p),
        "repetition_penalty": float(trainer.repetition_penalty),
        "max_completion_length": int(trainer.max_completion_length),
    }


def trl_kept(
    pi: Tensor,
    old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
    importance_sampling_level: str = "token",
) -> Tensor:
    """The tokens TRL 1.16's policy loss lets through, from its ratio against ``old``: ``(B, T)`` bool.

    ``pi``, ``old``: ``(B, T)`` log-probs (``old`` is TRL's ``old_per_token_logps``, or pi itself when TRL skips
    them); ``advantages`` ``(B,)`` or ``(B, T)``; ``mask`` ``(B, T)`` the tokens the loss covers. For the clipped
    loss types (:data:`CLIPPED_LOSS_TYPES`) a token is blocked where TRL counts it clipped, ``r < 1 - epsilon_low``
    with A < 0 or ``r > 1 + epsilon_high`` with A > 0 (``r`` capped at ``delta`` as TRL caps it), and where
    ``delta`` freezes the ratio of an A < 0 token (``r > delta``: its gradient is zero, though TRL's clip metrics
    do not count it). ``r`` is per token, or per sequence (the masked mean log-ratio) with
    ``importance_sampling_level="sequence"``. The other loss types block nothing here.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    keep = torch.ones_like(pi, dtype=torch.bool)  # (B, T)
    if loss_type in UNMASKED_LOSS_TYPES:
        return keep
    if loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not a TRL loss type trustscope knows: "
                         f"{sorted(CLIPPED_LOSS_TYPES | UNMASKED_LOSS_TYPES)}")
    log_ratio = (pi - old).float()  # (B, T)
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        m = mask.float()
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_w)
    capped = ratio if delta is None else ratio.clamp(max=delta)
    blocked = ((capped < 1 - epsilon_low) & (advantages < 0)) | ((capped > 1 + epsilon_high) & (advantages > 0))
    if delta is not None:
        blocked |= (ratio > delta) & (advantages < 0)
    return keep & ~blocked


def split_engine_logprobs(
    completion_ids: list[list[int]], logprobs: list[list[list[float | None]]], logprob_ids: list[list[list[int]]],
    k: int,
) -> tuple[list[list[list[float | None]]], list[list[list[int]]], list[list[list[float]]]]:
    """vLLM's per-token log-prob lists (sorted by rank, as TRL returns them) -> what TRL reads, and mu's top-K.

    TRL 1.16 keeps ``lp[0]`` of each token's list as the sampled token's log-prob, which holds only when vLLM was
    asked for no top-K. This returns the lists reordered with the sampled token's entry first (``None`` when vLLM
    did not score it), and per sequence the first ``k`` ids and log-probs by rank (NaN where missing); shapes
    ``(B, T_i, ...)``, ragged like the input.
    """
    trl_view, topk_ids, topk_lps = [], [], []
    for seq, seq_lps, seq_ids in zip(completion_ids, logprobs, logprob_ids, strict=True):
        view, ids_rows, lps_rows = [], [], []
        for token, lps, ids in zip(seq, seq_lps, seq_ids, strict=True):
            j = ids.index(token) if token in ids else None
            view.append([None if j is None else lps[j]] + [lp for i, lp in enumerate(lps) if i != j])
            row_ids = list(ids[:k]) + [0] * (k - min(k, len(ids)))
            row_lps = [math.nan if lp is None else float(lp) for lp in lps[:k]] + [math.nan] * (k - min(k, len(lps)))
            ids_rows.append(row_ids)
            lps_rows.append(row_lps)
        trl_view.append(view)
        topk_ids.append(ids_rows)
        topk_lps.append(lps_rows)
    return trl_view, topk_ids, topk_lps


@dataclass
class EngineCall:
    """One ``vllm_generation.generate`` call of a rollout: its id prompts, the engine's completions and, with
    top-K, mu's top-K per completion token (ragged, as :func:`split_engine_logprobs` returns them)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    topk_ids: list[list[list[int]]] | None = None
    topk_lps: list[list[list[float]]] | None = None


def _segments(tool_mask: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of 1s (the model's turns) in a completion's tool mask."""
    out, start = [], None
    for t, m in enumerate([*tool_mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t - start))
            start = None
    return out


def engine_rows(calls: list[EngineCall], prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]],
                tool_masks: list[tuple[int, ...]] | None, k: int
                ) -> tuple[list[list[int]], tuple[list, list] | None]:
    """Per completion of a rollout, the id the engine returned at each position (-1 on a tool's result and where
    no call produced it) and, when every call has them, mu's top-K there (ids 0 and NaN log-probs elsewhere).

    TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) calls the engine once for the whole batch (row i:
    completion i) and then once per round for the completions still calling tools, each row's prompt the
    completion's prompt + its ids so far + the tool's result (concatenated ids), its output spliced in after the
    result, cut to ``max_completion_length``. So the model turn of completion i starting at position s came from the
    later call whose prompt is ``prompts[i] + completions[i][:s]``; of several such rows (two completions with the
    same history), the one whose output matches the completion's ids.
    """
    first, index = calls[0], {}
    for call in calls[1:]:
        for r, p in enumerate(call.prompts):
            index.setdefault(tuple(p), []).append((call, r))
    with_topk = all(c.topk_ids is not None for c in calls)
    ids_out, tk_ids_out, tk_lps_out = [], [], []
    for i, comp in enumerate(completions):
        comp = list(comp)
        n = len(comp)
        ids, tk_ids, tk_lps = [-1] * n, [[0] * k for _ in range(n)], [[math.nan] * k for _ in range(n)]
        for s, length in _segments(tool_masks[i] if tool_masks is not None else [1] * n):
            if s == 0 and i < len(first.prompts) and tuple(first.prompts[i]) == tuple(prompts[i]):
                found = (first, i)
            else:
                rows = index.get(tuple(prompts[i]) + tuple(comp[:s]), [])
                found = next((cr for cr in rows if list(cr[0].completions[cr[1]][:length]) == comp[s:s + length]),
                             rows[0] if rows else None)
            if found is None:
                continue
            call, r = found
            got = list(call.completions[r][:length])
            ids[s:s + len(got)] = got
            if with_topk:
                tk_ids[s:s + len(got)] = call.topk_ids[r][:len(got)]
                tk_lps[s:s + len(got)] = call.topk_lps[r][:len(got)]
        ids_out.append(ids)
        tk_ids_out.append(tk_ids)
        tk_lps_out.append(tk_lps)
    return ids_out, ((tk_ids_out, tk_lps_out) if with_topk else None)


def _rows(ids: Tensor, mask: Tensor) -> list[tuple[int, ...]]:
    """The ids of each row where ``mask`` is set: ``(B, L)`` -> B tuples (one transfer, no per-row tensors)."""
    ids_np, mask_np = ids.cpu().numpy(), mask.bool().cpu().numpy()
    return [tuple(r[m].tolist()) for r, m in zip(ids_np, mask_np, strict=True)]


def _head_module(model: Any) -> Any:
    """The module TRL's fused LM head patched (the causal LM under any PEFT wrapper), or ``model`` without one."""
    return fused_head_forward(model) or model


def _backbone(model: Any) -> Any:
    """The module whose output's ``last_hidden_state`` is the LM head's input (the fused head calls it)."""
    head = _head_module(model)
    backbone = getattr(head, "base_model", None)
    if backbone is None or backbone is head:
        raise TRLVersionError(f"{type(head).__name__} has no backbone module (base_model) whose last hidden states "
                              f"feed its LM head, as TRL {TESTED_TRL}'s fused head reads them; use topk=0")
    return backbone


def _logit_transform(model: Any) -> tuple[float, float | None]:
    """The model's own scaling of its logits, ``(multiplier, soft cap)``, from its config: ``logit_scale``,
    ``output_multiplier`` or ``lm_head_multiplier`` multiply, ``logits_scaling`` divides (multiplies for
    HyperCLOVA X), ``final_logit_softcapping`` caps; TRL's fused head reads the same fields."""
    config = model.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(config, name, None) is not None:
            return float(getattr(config, name)), softcap
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        return (float(scaling) if config.model_type == "hyperclovax" else 1 / float(scaling)), softcap
    return 1.0, softcap


def _gathered(*params: Any) -> Any:
    """DeepSpeed ZeRO-3 gathers the LM head's partitioned parameters for a direct read, as TRL's fused head does
    (a no-op context otherwise)."""
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:
        return contextlib.nullcontext()
    return maybe_gather_lm_head_ctx(*params)


def _full(param: Any) -> Any:
    """An FSDP2 DTensor parameter as a plain tensor (all-gathered, as TRL's fused head gathers the head)."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _pad_rows(rows: list[list[Any]], width: int, k: int, fill: float, dtype: torch.dtype, device: Any) -> Tensor:
    """Ragged ``(B, T_i, K)`` rows -> ``(B, width, K)``, right-padded with ``fill``."""
    out = torch.full((len(rows), width, k), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)[:width]
    return out.to(device)


class _Hooks:
    """The wrappers around one trainer's methods, and what they pass from the rollout side to the loss side.

    Rollout side: ``_calculate_rewards`` (keeps the reward matrix), ``vllm_generation.generate`` (top-K, vLLM
    only), ``_generate_and_score_completions`` (tags the batch with sample ids, prompt groups, weighted rewards and
    top-K). Loss side: ``compute_loss`` opens a window in which ``_get_per_token_logps_and_entropies`` keeps the
    loss forward's log-probs and entropy, then logs the micro-batch.
    """

    def __init__(self, attachment: Attachment):
        self.a = attachment
        self.installed: list[tuple[Any, str]] = []
        self._rewards: Tensor | None = None
        self._engine_calls: list[EngineCall] = []  # the rollout's engine calls (several with tool calls)
        self._capturing = False
        self._hidden: list[tuple[Tensor, torch.dtype]] | None = None  # collected while the loss forward runs
        self.forward: tuple[Tensor, Tensor | None, tuple[Tensor, torch.dtype] | None] | None = None
        self._handles: list[Any] = []

    def install(self, trainer: Any) -> None:
        self._wrap(trainer, "_calculate_rewards", self.calculate_rewards)
        self._wrap(trainer, "_generate_and_score_completions", self.generate_and_score)
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self.per_token_logps)
        self._wrap(trainer, "compute_loss", self.compute_loss)
        if self.a.reporter is not None:
            self._wrap(trainer, "log", self.log)
        if trainer.use_vllm:  # the engine's ids (and, with topk, its top-K) of every call of a rollout
            self._wrap(trainer.vllm_generation, "generate", self.vllm_generate)
        if self.a.topk:
            backbone = _backbone(trainer.accelerator.unwrap_model(trainer.model))
            self._handles.append(backbone.register_forward_hook(self.backbone_output))

    def remove(self) -> None:
        for obj, name in reversed(self.installed):
            del obj.__dict__[name]  # the class's method shows through again
        self.installed.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _wrap(self, obj: Any, name: str, wrapper: Callable) -> None:
        original = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        wrapped.__wrapped__ = original  # inspect.signature sees TRL's parameters
        setattr(obj, name, wrapped)
        self.installed.append((obj, name))

    def log(self, original: Callable, logs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """TRL's ``log`` with the latest summarised step's ``trustscope/...`` metrics added to what it logs, so
        every ``report_to`` tracker receives them (training mode only)."""
        reporter = self.a.reporter
        if self.a.active and reporter is not None and getattr(self.a.trainer.model, "training", True):
            try:
                logs.update(reporter.metrics())
            except Exception as err:  # the metrics must never stop the training
                self.a._warn_once("metrics", f"the step metrics could not be added to TRL's logs: {err!r}")
        return original(logs, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------ rollout side

    def calculate_rewards(self, original: Callable, *args: Any, **kwargs: Any) -> Tensor:
        rewards = original(*args, **kwargs)  # (N_global, F): every process's completions
        self._rewards = rewards
        return rewards

    def vllm_generate(self, original: Callable, *args: Any, **kwargs: Any) -> tuple:
        """Each engine call of a rollout (TRL's tool loop makes one a round): keep its prompts, ids and top-K,
        and hand TRL the sampled token's log-prob first (with top-K)."""
        prompt_ids, completion_ids, logprobs, logprob_ids = original(*args, **kwargs)
        prompts = kwargs["prompts"] if "prompts" in kwargs else args[0]
        if not self.a.topk or logprobs is None or logprob_ids is None:
            self._engine_calls.append(EngineCall(list(prompts), list(completion_ids)))
            return prompt_ids, completion_ids, logprobs, logprob_ids
        view, ids, lps = split_engine_logprobs(completion_ids, logprobs, logprob_ids, self.a.topk)
        self._engine_calls.append(EngineCall(list(prompts), list(completion_ids), ids, lps))
        return prompt_ids, completion_ids, view, logprob_ids

    def generate_and_score(self, original: Callable, inputs: Any) -> dict[str, Any]:
        self._rewards, self._engine_calls = None, []
        out = original(inputs)
        if self.a.active and self.a.trainer.model.training:
            self.a.tag_rollout(out, self._rewards, self._engine_calls)
        self._engine_calls = []
        return out

    # --------------------------------------------------------------------------------------------------- loss side

    def backbone_output(self, module: Any, args: Any, output: Any) -> None:
        """Keep the loss forward's last hidden states (top-K only), with the dtype TRL's fused head multiplies
        them in: float32 with ``cast_lm_head_to_fp32``, else autocast's dtype when autocast is on, else theirs."""
        if self._hidden is None:
            return
        hidden = getattr(output, "last_hidden_state", None)
        hidden = (output[0] if hidden is None else hidden).detach()  # (b, L, H)
        device = hidden.device.type
        dtype = (torch.float32 if getattr(self.a.trainer.args, "cast_lm_head_to_fp32", False)
                 else torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype)
        self._hidden.append((hidden, dtype))

    def per_token_logps(self, original: Callable, *args: Any, **kwargs: Any) -> tuple:
        first = self._capturing and self.forward is None
        self._hidden = [] if first and self.a.topk else None
        try:
            out = original(*args, **kwargs)
            hidden = self._hidden
        finally:
            self._hidden = None
        if first:
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TRLVersionError(f"GRPOTrainer._get_per_token_logps_and_entropies returned "
                                      f"{type(out).__name__}; TRL {TESTED_TRL} returns (logps, entropies, aux_loss)")
            states = (torch.cat([h for h, _ in hidden]), hidden[0][1]) if hidden else None  # (B, L, H)
            self.forward = (out[0].detach(), None if out[1] is None else out[1].detach(), states)
        return out

    def compute_loss(self, original: Callable, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not (self.a.active and self.a.trainer.model.training):
            return original(model, inputs, *args, **kwargs)
        self.forward, self._capturing = None, True
        try:
            loss = original(model, inputs, *args, **kwargs)
        finally:
            self._capturing = False
        if self.forward is None:
            raise TRLVersionError(f"GRPOTrainer.compute_loss did not call _get_per_token_logps_and_entropies, as "
                                  f"TRL {TESTED_TRL} does; trustscope cannot read pi")
        self.a.log_micro_batch(inputs, *self.forward)
        self.forward = None
        return loss


class Attachment:
    """What :func:`attach` returns: the trainer, its :class:`~trustscope.logger.TokenLogger` (``logger``) and the
    installed hooks. :meth:`detach` removes the hooks and closes the log (done at the end of ``train()``)."""

    def __init__(self, trainer: Any, logger: TokenLogger, topk: int, topk_forward: bool,
                 reporter: StepReporter | None = None, alerts: Alerts | None = None):
        self.trainer = trainer
        self.logger = logger
        self.reporter = reporter
        """Adds the step summaries to TRL's logged metrics (None: ``metrics=False``)."""
        self.alerts = alerts
        self.topk = topk
        self.topk_forward = topk_forward
        self.active = True
        self.hooks = _Hooks(self)
        self.engine_logprobs: int | None = None  # vLLM's logprobs setting before attach raised it to topk
        self._rollouts = 0  # completions tagged so far, over all ranks
        self._unscored = 0  # tokens left out since the last scalars were written
        self._scalar_step: int | None = None
        self._scalar_names: set[str] = set()  # scalar names written at _scalar_step
        self._warned: set[str] = set()
        self.resume = bool(logger.manifest.get("resumes"))
        """A resumed run, not yet cut back to TRL's restored step (at ``on_train_begin``)."""

    def resume_at(self, step: int) -> int:
        """TRL resumes at ``step`` (``state.global_step`` once ``resume_from_checkpoint`` loaded): this rank's rows
        after ``step - 1`` go, so the resumed steps are logged once
        (:meth:`~trustscope.logger.TokenLogger.cut_back`). The main process also cuts back the ranks no process
        of this session writes (a resume on fewer processes) and counts a resume on another number of processes;
        a log that ends before the checkpoint is counted too, never a reason to stop (logging incidents,
        :mod:`trustscope.runformat.incidents`). Returns the files removed."""
        self.resume = False
        accelerator = self.trainer.accelerator
        if getattr(accelerator, "is_main_process", True):
            return self.logger.cut_back(step - 1, world=int(accelerator.num_processes))
        return self.logger.cut_back(step - 1)

    def detach(self) -> None:
        """Remove the hooks and close the log. Safe to call twice."""
        if not self.active:
            return
        self.active = False
        self.hooks.remove()
        if self.engine_logprobs is not None:  # TRL reads lp[0] as the sampled token's only with logprobs=0
            self.trainer.vllm_generation.logprobs = self.engine_logprobs
        if self.alerts is not None:
            self.alerts.close()
        self.logger.close()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"trustscope: {message}", LogWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------------------ rollout side

    def tag_rollout(self, out: dict[str, Any], rewards_global: Tensor | None,
                    engine_calls: list[EngineCall] | None = None) -> None:
        """Add sample ids, prompt groups, weighted rewards, the engine's ids and mu's top-K to TRL's batch (rows
        stay aligned when TRL shuffles and splits it)."""
        t = self.trainer
        ids = out["completion_ids"]  # (B, T)
        B, T = ids.shape
        rank, world = t.accelerator.process_index, t.accelerator.num_processes
        first = self._rollouts + rank * B
        rows = torch.arange(first, first + B, device=ids.device)  # (B,) global completion index
        out[_SAMPLE_ID] = rows
        out[_PROMPT_ID] = rows // t.num_generations  # TRL repeats each prompt num_generations times in a row
        out[_POLICY_VERSION] = torch.full((B,), self.weights_version(), dtype=torch.long, device=ids.device)
        self._rollouts += world * B
        if rewards_global is not None:
            local = rewards_global[rank * B : (rank + 1) * B]  # (B, F), TRL's process slice
            w = t.reward_weights.to(local.device)
            reward = (local * w).nansum(dim=1)  # (B,) TRL's weighted reward
            reward[torch.isnan(local).all(dim=1)] = torch.nan  # unscorable: TRL logs NaN too
            out[_REWARD] = reward.to(ids.device)
        engine_topk = self._tag_engine_ids(out, engine_calls) if engine_calls else None
        if not self.topk:
            return
        if engine_topk is not None:
            out[_TOPK_IDS] = _pad_rows(engine_topk[0], T, self.topk, 0, torch.long, ids.device)  # (B, T, K)
            out[_TOPK_LOGPROBS] = _pad_rows(engine_topk[1], T, self.topk, math.nan, torch.float32, ids.device)
        elif self.topk_forward:
            self._rollout_forward(out)

    def weights_version(self) -> int:
        """The step whose weights generate the rollout being tagged: on the vLLM path the step whose weights TRL
        last loaded into the engine (``_last_loaded_step``: TRL syncs them before a rollout whenever
        ``global_step`` moved), else ``global_step`` (the transformers path samples from the model in training)."""
        t = self.trainer
        loaded = getattr(t, "_last_loaded_step", None) if t.use_vllm else None
        if isinstance(loaded, int) and loaded >= 0:
            return loaded
        return int(t.state.global_step)

    def update_index(self) -> int:
        """Which optimizer update since the rollout this micro-batch trains: TRL generates once every
        ``steps_per_generation * num_iterations`` micro-batches (``_step``, the micro-batches trained so far) and
        makes one update every ``gradient_accumulation_steps`` of them, so it is ``(_step mod generate_every) //
        gradient_accumulation_steps``: iteration x ``steps_per_generation`` + slice when each update is one
        micro-batch. After a resume TRL counts ``_step`` from 0 and generates anew, and so does this."""
        t = self.trainer
        every = int(t.args.steps_per_generation) * int(t.args.num_iterations)
        return (int(t._step) % every) // max(int(t.args.gradient_accumulation_steps), 1)

    def _tag_engine_ids(self, out: dict[str, Any], calls: list[EngineCall]) -> tuple[list, list] | None:
        """The engine's id at each completion position (``(B, T)``, -1 where none) into the batch, from the
        rollout's engine calls (:func:`engine_rows`: with tool calls, each model turn from the call that sampled
        it); returns mu's top-K per completion when the calls have it."""
        completions = _rows(out["completion_ids"], out["completion_mask"])
        tool = _rows(out["tool_mask"], out["completion_mask"]) if "tool_mask" in out else None
        ids, topk = engine_rows(calls, _rows(out["prompt_ids"], out["prompt_mask"]), completions, tool, self.topk)
        B, T = out["completion_ids"].shape
        table = torch.full((B, T), -1, dtype=torch.long)
        for i, row in enumerate(ids):
            if row:
                table[i, : len(row)] = torch.tensor(row[:T], dtype=torch.long)
        out[_ENGINE_IDS] = table.to(out["completion_ids"].device)
        return topk

    @torch.no_grad()
    def _rollout_forward(self, out: dict[str, Any]) -> None:
        """The trainer's own top-K (and sampled-token log-prob) at the rollout's weights: one no-grad forward of the
        backbone, then one pass over the LM head's rows in tiles (:func:`~trustscope.capture.top_k_from_hidden`:
        no ``(B, T, V)`` logits)."""
        t = self.trainer
        model = _head_module(t.accelerator.unwrap_model(t.model))
        head = model.get_output_embeddings()
        scale, softcap = _logit_transform(model)
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)  # (B, P + T)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)  # (B, P + T)
        T = out["completion_ids"].shape[1]
        step = t.args.per_device_train_batch_size
        ids, lps, mu = [], [], []
        for start in range(0, input_ids.shape[0], step):
            sl = slice(start, start + step)
            hidden = _backbone(model)(input_ids=input_ids[sl], attention_mask=attention[sl]).last_hidden_state
            with _gathered(head.weight, head.bias):
                weight, bias = _full(head.weight), _full(head.bias)
                k_ids, k_lps, lp = top_k_from_hidden(
                    hidden[:, -(T + 1):-1].to(weight.device), weight, self.topk, bias=bias,
                    label_ids=out["completion_ids"][sl].to(weight.device), temperature=t.temperature,
                    logit_scale=scale, softcap=softcap)  # column t predicts completion token t
            ids.append(k_ids)
            lps.append(k_lps)
            mu.append(lp)
        device = out["completion_ids"].device
        out[_TOPK_IDS], out[_TOPK_LOGPROBS], out[_MU_RECOMPUTE] = (torch.cat(x).to(device) for x in (ids, lps, mu))

    # --------------------------------------------------------------------------------------------------- loss side

    def log_micro_batch(self, inputs: Mapping[str, Any], pi: Tensor, entropy: Tensor | None,
                        hidden: tuple[Tensor, torch.dtype] | None = None) -> None:
        """Log one micro-batch of TRL's loss: its tokens, mu, pi, entropy, advantages and applied mask (and, with
        top-K, pi at mu's ids from the loss forward's last hidden states ``hidden``: ``(B, L, H)`` and the dtype
        of the head's matmul)."""
        t = self.trainer
        if _SAMPLE_ID not in inputs:
            self._warn_once("untagged", "a batch generated before attach() was not logged")
            return
        completion = inputs["completion_ids"]  # (B, T)
        if pi.shape != completion.shape:
            raise TRLVersionError(f"the loss forward's log-probs have shape {tuple(pi.shape)}, the completions "
                                  f"{tuple(completion.shape)}; TRL {TESTED_TRL} scores every completion token")
        loss_mask = inputs["completion_mask"]  # (B, T)
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        engine = inputs.get("sampling_per_token_logps")
        if self.logger.mu_source == "engine":
            if engine is None:
                self._warn_once("no-engine", "mu_source is 'engine' but TRL's batch holds no "
                                "sampling_per_token_logps (a rollout_func without logprobs?): batch not logged")
                return
            mu = engine
        else:
            mu = old if old is not None else inputs.get(_MU_RECOMPUTE, pi)
        kept = self._kept(inputs, pi, entropy, loss_mask)  # (B, T)
        mask = loss_mask.bool() & torch.isfinite(mu) & torch.isfinite(pi)  # (B, T)
        tokens: dict[str, Any] = {"token_id": completion, "mu_logprob": torch.nan_to_num(mu), "pi_logprob": pi,
                                  "advantage": inputs["advantages"], "kept": kept}
        if entropy is not None:
            tokens["entropy"] = entropy
        if _POLICY_VERSION in inputs:  # (B,): the step whose weights generated each completion
            tokens["policy_version"] = inputs[_POLICY_VERSION]
            tokens["update_index"] = torch.full_like(inputs[_POLICY_VERSION], self.update_index(), dtype=torch.int32)
        if old is not None:
            tokens["old_logprob"] = torch.nan_to_num(old)
        if "tool_mask" in inputs:  # tool calls: each tool result (0 in tool_mask) starts the model's next turn
            tokens["turn"] = turns_from_mask(inputs["tool_mask"].bool().cpu().numpy())
        if _TOPK_IDS in inputs:
            mu_ids, mu_lps = force_sampled_into_topk(inputs[_TOPK_IDS], inputs[_TOPK_LOGPROBS], completion.long(),
                                                     mu.float())
            mask &= torch.isfinite(mu_lps).all(-1)
            tokens["mu_topk_ids"] = mu_ids
            tokens["mu_topk_logprobs"] = torch.nan_to_num(mu_lps)
            tokens["pi_topk_logprobs"] = self._pi_topk(inputs, mu_ids, pi, hidden)
        if _ENGINE_IDS in inputs:  # the vLLM path: the ids the engine returned, each turn from its own call
            engine_ids = inputs[_ENGINE_IDS]
            if bool(((engine_ids < 0) & mask).any()):
                self._warn_once("engine-ids", "some completion tokens have no engine id (a model turn no engine call "
                                "returned): engine_token_id is left out of those batches")
            else:
                tokens["engine_token_id"] = engine_ids
        self._unscored += int((loss_mask.bool() & ~mask).sum())
        self.logger.log_step(t.state.global_step, tokens=tokens, mask=mask,
                             samples=self._samples(inputs))

    def _kept(self, inputs: Mapping[str, Any], pi: Tensor, entropy: Tensor | None, loss_mask: Tensor) -> Tensor:
        """TRL's applied mask: the clip region (:func:`trl_kept`) and, when on, TRL's own off-policy,
        high-entropy and vLLM importance-sampling masks, computed by TRL's own methods on the same tensors."""
        t = self.trainer
        old = inputs.get("old_per_token_logps")
        old = pi if old is None else old
        keep = trl_kept(pi, old, inputs["advantages"], loss_mask, loss_type=t.loss_type,
                        epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high, delta=t.args.delta,
                        importance_sampling_level=t.importance_sampling_level)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        if t.off_policy_mask_threshold is not None:
            keep = keep & t.get_off_policy_mask(
                advantages=advantages, per_token_logps=pi,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=loss_mask,
                off_policy_threshold=t.off_policy_mask_threshold).bool()
        if t.top_entropy_quantile < 1.0 and entropy is not None:
            keep = keep & t.get_high_entropy_mask(entropy, loss_mask, 1 - t.top_entropy_quantile)
        if t.use_vllm and t.vllm_importance_sampling_correction and t.loss_type != "vespo":
            keep = keep & (inputs["importance_sampling_ratio"] > 0)
        return keep

    @torch.no_grad()
    def _pi_topk(self, inputs: Mapping[str, Any], mu_ids: Tensor, pi: Tensor,
                 hidden: tuple[Tensor, torch.dtype] | None) -> Tensor:
        """pi's log-probs at mu's top-K ids ``(B, T, K)`` from the loss forward: its last hidden states, the LM
        head's rows at the ids, and log Z from ``pi``, TRL's log-prob of each completion token (same temperature)."""
        model = _head_module(self.trainer.accelerator.unwrap_model(self.trainer.model))
        if hidden is None:
            raise TRLVersionError(f"the loss forward did not run the backbone of {type(model).__name__}, as TRL "
                                  f"{TESTED_TRL}'s fused LM head does; trustscope cannot score mu's top-K ids")
        states, dtype = hidden
        completion = inputs["completion_ids"]  # (B, T)
        T = completion.shape[1]
        if states.shape[0] != completion.shape[0] or states.shape[1] <= T:
            raise TRLVersionError(f"the loss forward's hidden states have shape {tuple(states.shape)}, the "
                                  f"completions {tuple(completion.shape)}; TRL {TESTED_TRL} runs prompt + completion")
        head = model.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        scale, softcap = _logit_transform(model)
        # a token whose pi is not finite is left out of the log (log_micro_batch's mask); any finite stand-in keeps
        # the call's check on the label's log-prob for the tokens that are logged
        label_lp = torch.where(torch.isfinite(pi), pi, torch.zeros_like(pi))  # (B, T)
        with _gathered(weight, bias):
            weight, bias = _full(weight), _full(bias)
            return logprobs_from_hidden(states[:, -(T + 1):-1].to(weight.device), weight, mu_ids.to(weight.device),
                                        bias=bias, label_ids=completion.to(weight.device),
                                        label_logprobs=label_lp.to(weight.device),
                                        temperature=self.trainer.temperature, logit_scale=scale, softcap=softcap,
                                        matmul_dtype=dtype).to(pi.device)

    def _samples(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The micro-batch's samples rows: ids, prompt group, texts, finish reason, advantage, weighted reward."""
        t = self.trainer
        prompts = _rows(inputs["prompt_ids"], inputs["prompt_mask"])
        responses = _rows(inputs["completion_ids"], inputs["completion_mask"])
        eos = set(getattr(t, "eos_token_ids", None) or [t.processing_class.eos_token_id])  # a list from TRL 1.15
        samples: dict[str, Any] = {  # texts: decoded by the logger's writer thread, for its text_fraction sample
            "sample_id": inputs[_SAMPLE_ID], "prompt_id": inputs[_PROMPT_ID],
            "prompt_token_ids": prompts, "response_token_ids": responses,
            "finish_reason": ["stop" if r and r[-1] in eos else "length" for r in responses],
        }
        if inputs["advantages"].dim() == 1:
            samples["advantage"] = inputs["advantages"]
        reward = inputs.get(_REWARD)
        if reward is not None:
            if torch.isfinite(reward).all():
                samples["reward"] = reward
            else:
                self._warn_once("nan-reward", "a batch with unscorable completions (every reward function returned "
                                "None) is logged without rewards")
        return samples

    # ------------------------------------------------------------------------------------------------- callbacks

    def on_log(self, step: int, logs: Mapping[str, Any]) -> None:
        """TRL's logged numbers as ``trl/<name>`` scalars at ``step`` (a name TRL logs twice at one step, as
        ``epoch`` in the end-of-training summary, keeps its first value)."""
        if not self.active:
            return
        if step != self._scalar_step:
            self._scalar_step, self._scalar_names = step, set()
        scalars = {f"trl/{k}": float(v) for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and f"trl/{k}" not in self._scalar_names
                   and not k.startswith("trustscope/")}  # the step summaries attach added: already in the log
        self._scalar_names.update(scalars)
        if self._unscored:
            scalars["trustscope/unscored_tokens"] = float(self._unscored)
            self._unscored = 0
        if scalars:
            self.logger.log_step(step, scalars=scalars)


def _callback(attachment: Attachment) -> Any:
    from transformers import TrainerCallback

    class TrustscopeCallback(TrainerCallback):
        """Cuts a resumed run back to TRL's restored step, flushes before a checkpoint, writes TRL's logged
        metrics as scalars and closes the trustscope log when training ends."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # after TRL restored a checkpoint (resume_from_checkpoint): global_step is the first step to train
            if attachment.resume:
                attachment.resume_at(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if control.should_save and not control.should_log:
                attachment.logger.flush()  # the checkpoint that follows finds its steps in the log

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> None:
            # TRL logs after the optimizer step: global_step has moved past the step the numbers describe
            attachment.on_log(max(state.global_step - 1, 0), logs or {})
            if control.should_save:
                attachment.logger.flush()  # the checkpoint that follows finds its steps in the log

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            attachment.detach()

    return TrustscopeCallback()


def attach(trainer: Any, logdir: str, topk: int = 0, *, topk_forward: bool = False, metrics: bool = True,
           metrics_wait_s: float = 1.0, webhook: str | None = None, warn_relative: float | None = None,
           **logger_options: Any) -> Attachment:
    """Log ``trainer`` (a TRL ``GRPOTrainer``) to ``logdir`` with trustscope. Call before ``trainer.train()``.

    Args:
        trainer: a ``trl.GRPOTrainer`` of TRL :data:`SUPPORTED_TRL` (checked: :func:`check_trainer`).
        logdir: the log directory; the run is ``<logdir>/<run_id>/``.
        topk: log mu's top-K ids and log-probs and pi's at the same ids (0: none). On the vLLM path the engine
            reports them; on the transformers path it needs ``topk_forward=True``. pi's log-probs at the ids come
            from the loss forward's last hidden states and K rows of the LM head (no extra forward, no logits).
        topk_forward: on the transformers path, stand the trainer's own top-K at the rollout's weights in for
            the engine's (one more no-grad forward per rollout). Ignored with vLLM.
        metrics: add the latest step's exact summaries, as ``trustscope/...`` metrics
            (:mod:`trustscope.trackers`, ``docs/trackers.md``), with the collapse early warning, to the metrics
            TRL logs, so every ``report_to`` tracker carries them (this process's tokens: with several
            processes, the main one's share).
        metrics_wait_s: how long TRL's ``log`` may wait for the logger's writer thread to summarise the step
            (0: never; the metrics are then those of the newest step it has summarised, ``trustscope/step``).
        webhook: a Slack-compatible webhook URL the early warning is posted to (:class:`trustscope.alerts.Alerts`,
            on a background thread); a malformed URL raises ``ValueError`` here. With ``report_to`` W&B or trackio
            the warning is also an alert there (``wandb.alert``, ``trackio.alert``), webhook or not.
        warn_relative: the early warning in the run's own terms (:class:`trustscope.early_warning.WarningLines`
            ``relative_z``): its lines that many robust deviations above the run's first steps, and the relative
            detector; None (the default) keeps the absolute lines and detector.
        **logger_options: passed to :class:`~trustscope.logger.TokenLogger` (``run_id``, ``token_fraction``,
            ``strict``, ...). Defaults set here: ``loss_rule="trl:<loss_type>"``, ``mu_source`` as the module
            docstring says, ``source``, ``sampling``, ``model``, ``tokenizer``, ``vocab``, ``rank`` (the
            accelerator's process index), and ``strict=False`` (a bad row is dropped with a warning rather than
            stopping the training). A given ``config`` is stored beside TRL's settings.

    Returns:
        :class:`Attachment` (``.logger`` is the run's logger; ``.detach()`` undoes attach early).
    """
    import trl

    check_trainer(trainer)
    warning = WarningWiring.check(webhook, warn_relative)  # a bad value fails here, naming it
    if isinstance(metrics_wait_s, bool) or not isinstance(metrics_wait_s, int | float) \
            or not 0 <= metrics_wait_s < math.inf:
        raise ValueError(f"metrics_wait_s must be a finite number of seconds >= 0, got {metrics_wait_s!r}")
    if "compute_loss" in vars(trainer):
        raise ValueError("this trainer already has an attachment (or another wrapper of compute_loss); attach once "
                         "per trainer, or detach() the first")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(f"topk must be an int >= 0, got {topk!r}")
    engine_logprobs = trainer.use_vllm or trainer.rollout_func is not None
    if topk and not trainer.use_vllm:
        if trainer.rollout_func is not None:
            raise ValueError("topk with a rollout_func: TRL's rollout_func returns no top-K; use topk=0")
        if not topk_forward:
            raise ValueError(f"topk={topk} on TRL's transformers path (use_vllm=False) has no engine top-K to read; "
                             f"pass topk_forward=True to recompute it with one extra forward per rollout (a "
                             f"recompute, like mu on this path), or topk=0")
    if topk and trainer.use_vllm:
        config = getattr(getattr(getattr(trainer.vllm_generation, "llm", None), "llm_engine", None), "model_config",
                         None)
        most = getattr(config, "max_logprobs", None)  # colocate mode; a server checks its own
        if most is not None and 0 <= most < topk:
            raise ValueError(f"topk={topk} exceeds the colocated vLLM engine's max_logprobs={most} (TRL starts it "
                             f"with vLLM's default); use topk <= {most}")
    if topk:
        _backbone(trainer.accelerator.unwrap_model(trainer.model))  # pi's top-K reads its hidden states
    mu_source = logger_options.pop("mu_source", "engine" if engine_logprobs else "trainer_recompute")
    if mu_source == "trainer_recompute":
        warnings.warn("trustscope: TRL keeps no rollout log-probs without vLLM (use_vllm=False), so mu is the "
                      "trainer's own recompute (mu_source='trainer_recompute'): training-inference mismatch will "
                      "read zero and the dashboard cannot compare anchoring to mu against pi_old",
                      LogWarning, stacklevel=2)
    settings = trl_settings(trainer)
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    model = trainer.accelerator.unwrap_model(trainer.model)
    options: dict[str, Any] = {
        "loss_rule": f"trl:{trainer.loss_type}",
        "source": {"framework": "trl", "version": trl.__version__},
        "sampling": {"engine": "vllm" if trainer.use_vllm else "transformers",
                     **{k: settings[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
                     "max_tokens": settings["max_completion_length"], "logprobs": topk,
                     "logprobs_mode": "processed_logprobs" if trainer.use_vllm else None},
        "model": {"name": getattr(model, "name_or_path", type(model).__name__)},
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", type(tokenizer).__name__)},
        "vocab": tokenizer,
        "rank": trainer.accelerator.process_index,
        "strict": False,
    }
    user_config = logger_options.pop("config", None)
    options.update(logger_options)
    options["config"] = {"trl": settings, **({"user": dict(user_config)} if user_config else {})}
    logger = TokenLogger(logdir, mu_source=mu_source, **options)
    main = getattr(trainer.accelerator, "is_main_process", True)
    reporter, alerts = warning.build(logger, getattr(trainer.args, "report_to", None), metrics=metrics,
                                     posts=main, wait_s=metrics_wait_s)  # one process posts; W&B / trackio alerts
    attachment = Attachment(trainer, logger, topk, topk_forward and not trainer.use_vllm, reporter, alerts)
    if trainer.use_vllm and topk:
        attachment.engine_logprobs = trainer.vllm_generation.logprobs
        trainer.vllm_generation.logprobs = topk
    attachment.hooks.install(trainer)
    trainer.add_callback(_callback(attachment))
    return attachment
