"""The frameworks' own training-inference mismatch figures, reproduced from the token rows: one declaration each.

verl, prime-rl, slime and TRL each log a handful of mismatch figures of their own (verl's ``rollout_corr/*`` and
``training/rollout_probs_diff_*``, prime-rl's ``mismatch_kl/*``, slime's ``train_rollout_logprob_abs_diff``,
``tis``, ``tis_clipfrac``, TRL's ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``).
trustscope computes the same figures from the rows it logged, under the names the
framework gives them, so a user reads their framework's number beside the token rows behind it.

Each figure is a :class:`FrameworkMetric` of :data:`METRICS`: its name exactly as the framework logs it, the view of
``trustscope/sql/views`` that computes it, the rows it is taken over, its aggregation (token mean, sequence mean,
...), its formula and the framework function it reproduces. Each framework is a :class:`Framework` of
:data:`FRAMEWORKS`: which logged column is its "training" side and which its "rollout" side, which rows its mask
covers, and where trustscope's figure departs from the framework's. The views (one per framework figure family),
the long view ``framework_metrics`` the report and the trackers read, the tracker metrics
(:func:`trustscope.trackers.framework_step_metrics`), the report section (:mod:`trustscope.report_frameworks`) and
the table of ``docs/frameworks-metrics.md`` (:func:`metrics_markdown`) all read these tuples.

Thresholds the frameworks configure (verl's ``rollout_is_threshold``, slime's ``--tis-clip``/``--tis-clip-low``)
are analysis parameters (:data:`PARAMETERS`, bound like the other analysis settings: ``LogDB.cursor(**analysis)``),
defaulting to the frameworks' own defaults.

Imports nothing heavy: read paths (``sql``, ``report``, ``dashboard``) load it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARAMETERS: dict[str, float] = {
    "verl_rollout_is_threshold": 2.0,
    "verl_rollout_is_threshold_lower": 0.0,
    "slime_tis_clip": 2.0,
    "slime_tis_clip_low": 0.0,
    "trl_is_clip_min": 0.0,
    "trl_is_clip_max": 3.0,
}
"""The frameworks' thresholds as analysis parameters, at the frameworks' defaults: verl's
``algorithm.rollout_correction.rollout_is_threshold`` (upper; ``_lower`` 0 means verl's single-float form, TIS:
weights clamped at the upper bound, the low fraction measured against 1/upper; a lower bound > 0 is verl's
``"lower_upper"`` form, IcePop: weights outside [lower, upper] zeroed), and slime's ``--tis-clip`` and
``--tis-clip-low``, and TRL's ``vllm_importance_sampling_clip_min`` (0: TRL's default None, no lower bound) and
``vllm_importance_sampling_clip_max``."""


@dataclass(frozen=True)
class Framework:
    """A framework whose own mismatch figures trustscope reproduces."""

    name: str
    release: str
    """The release whose code the formulas were read from."""
    training: str
    """The logged column that is the framework's "training" log-prob, and why."""
    rollout: str
    """The logged column that is its "rollout" (inference) log-prob."""
    rows: str
    """The token rows the figures are taken over: the framework's mask."""
    departs: str
    """Where trustscope's figure can differ from the framework's, and why."""


FRAMEWORKS: tuple[Framework, ...] = (
    Framework(
        "verl", "verl 0.9.1 (the installed package; `pip install 'trustscope[verl]'`)",
        "`old_logprob` (verl's `old_log_probs`, the actor's recompute before the update: its decoupled mode); a "
        "row without it reads `pi_logprob` (bypass mode, where verl compares the updating policy with the rollout)",
        "`mu_logprob` (verl's `rollout_log_probs`)",
        "every logged row of the step, which is verl's `response_mask` before rollout rejection sampling "
        "overwrites it where the log holds every response token with `rollout_rejected` marking the ones rejection "
        "sampling took out; a log of the surviving tokens only gives the figures over the survivors (and no "
        "rejected share)",
        "verl computes these once per batch on the driver; with `parameter_sync_step` > 1 (verl V1) it computes "
        "them once per trigger and its metrics aggregator combines them, while trustscope computes one figure over "
        "the step's tokens. A response trained by several updates of a step (`ppo_epochs` > 1) has rows in each: "
        "means, shares and extremes are unchanged by that even repetition, the sample standard deviations are "
        "taken over the repeated rows. A sequence of the batch without a response token is no row here (verl "
        "counts it in its per-sequence means)."),
    Framework(
        "prime-rl", "prime-rl main of 2026-08 (`src/prime_rl/trainer/rl/train.py`, `loss.py`, `utils.py`)",
        "`pi_logprob` (prime-rl's `trainer_logprobs`, the loss forward's; one optimizer step per batch)",
        "`mu_logprob` (prime-rl's `inference_logprobs`)",
        "every logged row: prime-rl's `loss_mask` (the rows the importer writes)",
        "per environment where the run has a column `env` (`TokenLogger(extra_columns={'env': 'string'})`); "
        "without it only `mismatch_kl/all/*`."),
    Framework(
        "slime", "slime main of 2026-08 (`slime/backends/megatron_utils/loss.py`, `cp_utils.py`)",
        "`old_logprob` (slime's `batch['log_probs']`, the trainer's recompute before the update); a row "
        "without it reads `pi_logprob` (slime then takes the current policy's log-probs)",
        "`mu_logprob` (slime's `rollout_log_probs`)",
        "every logged row: slime's `loss_masks`",
        "slime's default reducer divides by the step's rollout count, each sequence's token mean weighted "
        "alike (`get_sum_of_sample_mean`); a rollout of several samples shares one denominator there, while "
        "trustscope counts each logged sequence as its own rollout. `--use-rollout-logprobs` compares the "
        "current policy instead of `log_probs`: not reproduced."),
    Framework(
        "trl", "TRL 1.16 (the installed package; `GRPOTrainer._generate_and_score_completions`)",
        "`old_logprob` (TRL's `old_per_token_logps`, the trainer's recompute at the rollout's weights, which TRL "
        "always computes with `vllm_importance_sampling_correction`); a row without it reads `pi_logprob`",
        "`mu_logprob` (vLLM's `sampling_per_token_logps`)",
        "every logged row: TRL's `completion_mask * tool_mask` (the rows the integration logs)",
        "TRL computes these once per generation batch on each process and averages the processes' means (and "
        "the batches since the last log); trustscope computes one figure over each optimizer step's rows. They "
        "agree on one process with `steps_per_generation` and `num_iterations` 1 (and `logging_steps` 1); "
        "with `num_iterations` > 1 a token is logged once per iteration, which leaves means and extremes as "
        "they are."),
)

FRAMEWORK_NAMES = tuple(f.name for f in FRAMEWORKS)


@dataclass(frozen=True)
class FrameworkMetric:
    """One figure a framework logs, as trustscope reproduces it from the token rows."""

    framework: str
    name: str
    """Exactly as the framework logs it (a ``{env}`` part: the environment, ``all`` over every row)."""
    view: str
    """The view of ``sql/views`` that computes it (a column of that name, or rows of that name)."""
    aggregation: str
    formula: str
    source: str
    """The framework file and function it reproduces."""
    variants: tuple[str | None, ...] = (None,)
    """The settings it is computed under (``variant`` of the ``framework_metrics`` view); None: the one way."""


_OFF = "verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics"
_IS = "verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_weights, compute_is_metrics"
_RS = "verl/trainer/ppo/rollout_corr_helper.py compute_rollout_rejection_mask"
_DEBUG = "verl/utils/debug/metrics.py calculate_debug_metrics"
_LEVELS = ("rollout_is=token", "rollout_is=sequence")
_PRIME = ("prime_rl/trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl; train.py (mismatch_mask = "
          "loss_mask); utils.py Tensors.compute_stats")
_SLIME = "slime/backends/megatron_utils/loss.py policy_loss_function, vanilla_tis_function; cp_utils.py " \
         "get_sum_of_sample_mean"
_REDUCERS = (None, "calculate_per_token_loss")
_TRL = "trl/trainer/grpo_trainer.py GRPOTrainer._generate_and_score_completions"
_TRL_MODES = tuple(f"vllm_importance_sampling_mode={m}" for m in ("sequence_mask", "sequence_truncate",
                                                                   "token_mask", "token_truncate"))
_SEQ = "sequence mean of token means (slime's default reducer); token mean with `--calculate-per-token-loss`"


def _verl(name: str, view: str, aggregation: str, formula: str, source: str,
          variants: tuple[str | None, ...] = (None,)) -> FrameworkMetric:
    return FrameworkMetric("verl", name, view, aggregation, formula, source, variants)


METRICS: tuple[FrameworkMetric, ...] = (
    _verl("rollout_corr/training_ppl", "verl_rollout_corr", "sequence mean", "exp(-mean_t log pi_train)", _OFF),
    _verl("rollout_corr/training_log_ppl", "verl_rollout_corr", "sequence mean", "-mean_t log pi_train", _OFF),
    _verl("rollout_corr/kl", "verl_rollout_corr", "token mean", "log mu - log pi_train", _OFF),
    _verl("rollout_corr/k3_kl", "verl_rollout_corr", "token mean", "r - log r - 1, r = pi_train / mu", _OFF),
    _verl("rollout_corr/rollout_ppl", "verl_rollout_corr", "sequence mean", "exp(-mean_t log mu)", _OFF),
    _verl("rollout_corr/rollout_log_ppl", "verl_rollout_corr", "sequence mean", "-mean_t log mu", _OFF),
    _verl("rollout_corr/log_ppl_diff", "verl_rollout_corr", "sequence mean",
          "d = mean_t log mu - mean_t log pi_train", _OFF),
    _verl("rollout_corr/log_ppl_abs_diff", "verl_rollout_corr", "sequence mean", "\\|d\\|", _OFF),
    _verl("rollout_corr/log_ppl_diff_max", "verl_rollout_corr", "sequence max", "d", _OFF),
    _verl("rollout_corr/log_ppl_diff_min", "verl_rollout_corr", "sequence min", "d", _OFF),
    _verl("rollout_corr/ppl_ratio", "verl_rollout_corr", "sequence mean", "exp(d): training PPL / rollout PPL",
          _OFF),
    _verl("rollout_corr/chi2_token", "verl_rollout_corr", "token mean, minus 1",
          "r^2, r = exp(clamp(log r, -20, 20))", _OFF),
    _verl("rollout_corr/chi2_seq", "verl_rollout_corr", "sequence mean, minus 1",
          "exp(2 clamp(sum_t log r, -20, 20))", _OFF),
    _verl("rollout_corr/rollout_rs_masked_fraction", "verl_rollout_corr", "token share",
          "`rollout_rejected` (null when the rows do not say)", _RS),
    _verl("rollout_corr/rollout_rs_seq_masked_fraction", "verl_rollout_corr", "sequence share",
          "a sequence with any `rollout_rejected` token", _RS),
    _verl("training/rollout_probs_diff_valid", "verl_rollout_corr", "1 when the step has rows", "1", _DEBUG),
    _verl("training/rollout_probs_diff_max", "verl_rollout_corr", "token max", "\\|pi_train - mu\\| (probabilities)",
          _DEBUG),
    _verl("training/rollout_probs_diff_mean", "verl_rollout_corr", "token mean", "\\|pi_train - mu\\|", _DEBUG),
    _verl("training/rollout_probs_diff_std", "verl_rollout_corr", "token sample std", "\\|pi_train - mu\\|",
          _DEBUG),
    _verl("training/rollout_actor_probs_pearson_corr", "verl_rollout_corr", "Pearson correlation over tokens",
          "pi_train and mu (probabilities)", _DEBUG),
    _verl("rollout_corr/rollout_is_mean", "verl_rollout_is", "token mean", "w: the applied IS weight", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_max", "verl_rollout_is", "token max (sequence: max raw sequence weight)", "w",
          _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_min", "verl_rollout_is", "token min (sequence: min raw sequence weight)", "w",
          _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_std", "verl_rollout_is", "token population std",
          "clamp(w, 0, upper)", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_eff_sample_size", "verl_rollout_is", "1 / token mean",
          "(w' / mean w')^2, w' = clamp(w, 0, upper)", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_ratio_fraction_high", "verl_rollout_is",
          "token share (sequence: share of sequences)", "raw weight > upper", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_ratio_fraction_low", "verl_rollout_is",
          "token share (sequence: share of sequences)", "raw weight < lower (1/upper under TIS)", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_mean", "verl_rollout_is", "sequence mean", "s = mean_t w", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_std", "verl_rollout_is", "sequence sample std", "s", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_max", "verl_rollout_is", "sequence max", "s", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_min", "verl_rollout_is", "sequence min", "s", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_max_deviation", "verl_rollout_is", "sequence max", "\\|s - 1\\|", _IS,
          _LEVELS),
    _verl("rollout_corr/rollout_is_seq_fraction_high", "verl_rollout_is", "sequence share",
          "mean_t raw weight > upper", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_seq_fraction_low", "verl_rollout_is", "sequence share",
          "mean_t raw weight < lower", _IS, _LEVELS),
    _verl("rollout_corr/rollout_is_oob_ratio", "verl_rollout_is", "token share (IcePop only: a lower bound > 0)",
          "raw weight outside [lower, upper]", _IS, _LEVELS),
    *(FrameworkMetric("prime-rl", f"mismatch_kl/{{env}}/{stat}", "prime_rl_mismatch_kl", aggregation,
                      "exp(l) - l - 1, l = log pi_train - log mu", _PRIME)
      for stat, aggregation in (("mean", "token mean"), ("median", "token median (the lower middle value, as "
                                                          "torch.median)"),
                                ("std", "token sample std"), ("min", "token min"), ("max", "token max"))),
    FrameworkMetric("slime", "train_rollout_logprob_abs_diff", "slime_mismatch", _SEQ,
                    "\\|log pi_train - log mu\\|", _SLIME, _REDUCERS),
    FrameworkMetric("slime", "tis", "slime_mismatch", _SEQ, "exp(log pi_train - log mu)", _SLIME, _REDUCERS),
    FrameworkMetric("slime", "tis_clipfrac", "slime_mismatch", _SEQ,
                    "clamp(tis, tis_clip_low, tis_clip) != tis", _SLIME, _REDUCERS),
    FrameworkMetric("slime", "tis_abs", "slime_mismatch", _SEQ, "\\|tis - 1\\|", _SLIME, _REDUCERS),
    FrameworkMetric("trl", "sampling/sampling_logp_difference/mean", "trl_sampling", "token mean",
                    "\\|log pi_train - log mu\\|", _TRL),
    FrameworkMetric("trl", "sampling/sampling_logp_difference/max", "trl_sampling", "token max",
                    "\\|log pi_train - log mu\\|", _TRL),
    *(FrameworkMetric("trl", f"sampling/importance_sampling_ratio/{stat}", "trl_sampling",
                      f"token {stat} (sequence_* modes: over sequences)",
                      "exp(log pi_train - log mu) per token, or exp of its sum per sequence, clamped to the bounds "
                      "(the truncate modes) or zeroed outside them (the mask modes)", _TRL, _TRL_MODES)
      for stat in ("min", "mean", "max")),
)
"""Every reproduced figure."""

HEADLINES: dict[str, tuple[str, ...]] = {
    "verl": ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/ppl_ratio", "rollout_corr/chi2_token",
             "rollout_corr/chi2_seq", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_ratio_fraction_high",
             "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction",
             "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"),
    "prime-rl": ("mismatch_kl/all/mean", "mismatch_kl/all/median", "mismatch_kl/all/max"),
    "slime": ("train_rollout_logprob_abs_diff", "tis", "tis_clipfrac"),
    "trl": ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max"),
}
"""The figures the report shows of each framework (the rest are in the views)."""

SOURCE_FRAMEWORKS: dict[str, str] = {"verl": "verl", "prime-rl": "prime-rl", "slime": "slime", "miles": "slime",
                                     "trl": "trl"}
"""A run's ``run.json`` ``source.framework`` -> the framework whose figures it is shown with (miles, slime's fork,
computes slime's)."""

DEFAULT_VARIANTS: dict[str, str | None] = {"verl": "rollout_is=sequence", "prime-rl": None, "slime": None,
                                           "trl": "vllm_importance_sampling_mode=sequence_mask"}
"""The setting each framework's figures are shown under where one is picked (the trackers, the report): the
framework's own default (verl 0.9's ``RolloutCorrectionConfig.rollout_is = "sequence"``, slime without
``--calculate-per-token-loss``, TRL's ``vllm_importance_sampling_mode = "sequence_mask"``)."""

VIEWS = (*dict.fromkeys(m.view for m in METRICS), "framework_metrics")
"""The framework views, then the long view over them all."""


def framework(name: str) -> Framework:
    """The declaration of framework ``name``; KeyError names the known ones."""
    for f in FRAMEWORKS:
        if f.name == name:
            return f
    raise KeyError(f"no framework {name!r}; trustscope reproduces the figures of {list(FRAMEWORK_NAMES)}")


def metrics_of(framework_name: str) -> tuple[FrameworkMetric, ...]:
    """The declared figures of one framework (KeyError: an unknown framework, naming the known ones)."""
    framework(framework_name)
    return tuple(m for m in METRICS if m.framework == framework_name)


def metric_names(framework_name: str | None = None) -> tuple[str, ...]:
    """The declared names (with ``{env}`` as declared), of one framework or all."""
    chosen = METRICS if framework_name is None else metrics_of(framework_name)
    return tuple(m.name for m in chosen)


def metrics_markdown() -> str:
    """``docs/frameworks-metrics.md``'s table of every reproduced figure (a generated block)."""
    lines = ["| framework | name | computed under | aggregation | of | reproduces |", "|---|---|---|---|---|---|"]
    for m in METRICS:
        variants = ", ".join(f"`{v}`" for v in m.variants if v) or "-"
        lines.append(f"| {m.framework} | `{m.name}` | {variants} | {m.aggregation} | {m.formula} | `{m.source}` |")
    return "\n".join(lines) + "\n"


def frameworks_markdown() -> str:
    """``docs/frameworks-metrics.md``'s table of each framework's sides, rows and departures (a generated block)."""
    lines = ["| framework | read from | training side | rollout side | rows | where trustscope departs |",
             "|---|---|---|---|---|---|"]
    for f in FRAMEWORKS:
        lines.append(f"| {f.name} | {f.release} | {f.training} | {f.rollout} | {f.rows} | {f.departs} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- over rows in memory

NEEDS: dict[str, str] = {"run_id": "varchar", "step": "bigint", "sample_id": "bigint", "mu_logprob": "float",
                         "old_logprob": "float", "pi_logprob": "float", "rollout_rejected": "boolean",
                         "update_index": "integer"}
"""The token columns the framework views read (a run's own ``env`` too, where it has one), with their SQL types:
:func:`compute` adds the :data:`OPTIONAL` ones a table lacks as nulls. A sequence is a ``sample_id`` once per
``update_index`` (a response trained by several updates of a step has its rows once per update)."""
OPTIONAL = ("old_logprob", "rollout_rejected", "update_index")


def compute(tokens: Any, view: str = "framework_metrics", *, token_fraction: float | None = None,
            analysis: Mapping[str, float] | None = None) -> Any:
    """The framework view ``view`` over the token rows ``tokens`` (a ``pyarrow.Table`` with the :data:`NEEDS`
    columns, the :data:`OPTIONAL` ones optional), as a ``pyarrow.Table``: the same SQL files the
    log directory's views run, on an in-memory DuckDB (what the trackers report from a step's rows, and what the
    tests hold to the frameworks' own functions). ``token_fraction``: the share of token rows the logger kept (the
    long view's ``exact``); ``analysis``: :data:`PARAMETERS` to override.

    Raises ValueError naming the view (not one of :data:`VIEWS`), the parameter (not one of :data:`PARAMETERS`)
    or the missing column."""
    import duckdb
    import pyarrow as pa

    from trustscope.query.catalogue import CONNECTION_CONFIG, MACRO_DIR, VIEW_DIR

    if view not in VIEWS:
        raise ValueError(f"view {view!r} is not a framework view; they are {list(VIEWS)}")
    unknown = sorted(set(analysis or {}) - set(PARAMETERS))
    if unknown:
        raise ValueError(f"unknown framework parameter(s) {unknown}; known: {sorted(PARAMETERS)}")
    if not isinstance(tokens, pa.Table):
        raise ValueError(f"tokens must be a pyarrow.Table, got {type(tokens).__name__}")
    for name, kind in NEEDS.items():
        if name not in tokens.column_names:
            if name not in OPTIONAL:
                raise ValueError(f"tokens lacks column {name!r}; the framework views read {list(NEEDS)}")
            kinds = {"boolean": pa.bool_(), "integer": pa.int32(), "float": pa.float32()}
            tokens = tokens.append_column(name, pa.nulls(len(tokens), kinds[kind]))
    con = duckdb.connect(config=CONNECTION_CONFIG)
    try:
        con.execute("set variable trustscope_params = ?",
                    [{"analysis": {k: float(v) for k, v in {**PARAMETERS, **(analysis or {})}.items()}}])
        con.execute((MACRO_DIR / "analysis_param.sql").read_text())
        con.register("tokens", tokens)
        manifest = json.dumps({} if token_fraction is None else {"logging": {"token_fraction": float(token_fraction)}})
        con.execute("create table runs (run_id varchar, manifest json)")
        con.execute("insert into runs select distinct run_id, ?::json from tokens", [manifest])
        for name in VIEWS:
            con.execute(f"create view {name} as\n{(VIEW_DIR / f'{name}.sql').read_text()}")
        return con.view(view).to_arrow_table()
    finally:
        con.close()
