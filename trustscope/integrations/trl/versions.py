"""The TRL releases this integration supports and the internals it relies on, probed on the trainer before anything
is wrapped (:func:`check_trainer`)."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from trustscope.extras import release_position
from trustscope.logger import LogWarning

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
