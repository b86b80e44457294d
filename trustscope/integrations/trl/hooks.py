"""The wrappers on one trainer instance's methods (:class:`_Hooks`): what each reads from TRL's batch, loss forward
and logs, and the batch keys attach adds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from trustscope.capture import fused_head_forward
from trustscope.integrations.trl.engine import EngineCall, split_engine_logprobs
from trustscope.integrations.trl.versions import TESTED_TRL, TRLVersionError

# Keys attach adds to TRL's batch dict; TRL shuffles and splits them with the rest (they are (B, ...) tensors).
_SAMPLE_ID, _PROMPT_ID, _REWARD = "trustscope_sample_id", "trustscope_prompt_id", "trustscope_reward"
_ENGINE_IDS = "trustscope_engine_ids"
_TOPK_IDS, _TOPK_LOGPROBS, _MU_RECOMPUTE = "trustscope_mu_topk_ids", "trustscope_mu_topk_logprobs", "trustscope_mu"
_POLICY_VERSION = "trustscope_policy_version"


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

    def __init__(self, attachment: Any):  # the Attachment (attach.py) that owns these wrappers
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
