"""One declaration per column of the log tables and per dimension of the exact summaries.

Every column is a :class:`Column`: its name, Arrow type, nullability, how ``log_step`` takes it (per token, per
response, top-K list, or written by the logger), the check it gets, its line in ``docs/logging.md``, and the table
version that added it (files written before read NULL there). The Arrow schemas (:data:`trustscope.runformat.layout.SCHEMAS`),
the Parquet encodings, what ``log_step`` accepts and how it checks it (:mod:`trustscope.logger.checks`),
``trustscope validate``, the list of built-in columns the SQL views pass user columns beside
(:func:`builtin_token_columns_sql`) and the schema tables of ``docs/logging.md`` all read these tuples.

Adding a per-token column is one entry in :data:`TOKEN_COLUMNS` (appended, with ``since`` the new tokens table
version, and nullable: older files lack it) and, when none of the :data:`CHECKS` fits, one new check kind.

A run may declare its own per-token columns (``TokenLogger(extra_columns={"env": "string"})``): each becomes a
nullable :class:`Column` of one of :data:`EXTRA_TYPES` (:func:`extra_columns`), recorded in ``run.json``, checked
like the built-in ones and present in every tokens view.

Every dimension of the exact summaries is a :class:`Dimension`: how a token maps to its bucket (numpy, for the
logger) and the same in SQL (a macro of ``sql/macros``, for the views over the token rows). The summaries hold every
metric once per dimension bucket, beside the advantage sign x mu bucket grouping (see
:mod:`trustscope.logger.summaries`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

GIVEN = ("token", "sequence", "token_or_sequence", "topk", "token_list", "routing", "logger")
"""How ``log_step`` takes a column: ``(B, T)`` per token, ``(B,)`` per response, either (a ``(B,)`` value is
broadcast over the response), ``(B, T, K)`` top-K lists (one K for the three top-K columns and the whole run),
``(B, T, L)`` a list per token of any other length (ragged: ``(T_i, L)`` per response), ``(B, T, L, k)`` routed
experts (MoE layers x top-k, stored flat, layer by layer), or never (the logger writes it)."""


@dataclass(frozen=True)
class Check:
    """The check a given column gets at ``log_step`` (and ``validate``): a kind of :data:`CHECKS` and its bounds."""

    kind: str
    low: float = -np.inf
    high: float = np.inf


CHECKS = {
    "logprob": "finite and <= 0 (up to LOGPROB_TOLERANCE, which is clamped to 0)",
    "range": "finite and in [low, high]",
    "finite": "finite",
    "token_id": "an integer in [0, vocabulary size)",
    "bool": "boolean (or 0/1)",
    "version": "an integer in [0, step]: a weight version the trainer had already reached",
    "turn": "an integer >= 0 that never decreases along a response",
    "int": "an integer that fits the column",
    "text": "a string of valid UTF-8 (or None)",
}
"""The check kinds, each implemented once in :mod:`trustscope.logger.checks` (:data:`~trustscope.logger.checks.
CHECKERS`); the text is what the docs say of it."""


@dataclass(frozen=True)
class Column:
    """One column of a log table."""

    name: str
    type: pa.DataType
    nullable: bool
    doc: str
    given: str = "logger"
    check: Check | None = None
    since: int = 1
    """The table version that added the column; files of an older version lack it and read NULL there."""
    dictionary: bool = False
    """Parquet dictionary encoding (a handful of distinct strings)."""
    statistics: bool = True
    """Parquet min/max statistics (no query prunes on the top-K lists)."""

    def __post_init__(self) -> None:
        if self.given not in GIVEN:
            raise ValueError(f"column {self.name!r}: given must be one of {GIVEN}, got {self.given!r}")
        if self.check is not None and self.check.kind not in CHECKS:
            raise ValueError(f"column {self.name!r}: check kind {self.check.kind!r} is not one of {list(CHECKS)}")
        if self.since > 1 and not self.nullable:
            raise ValueError(f"column {self.name!r} was added by table version {self.since}: it must be nullable "
                             f"(older files lack it)")

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)

    @property
    def is_float(self) -> bool:
        """Floats, and lists of floats or ints (top-K): stored BYTE_STREAM_SPLIT (see ``WriteOptions``)."""
        t = self.type.value_type if pa.types.is_list(self.type) else self.type
        return pa.types.is_floating(t) or (pa.types.is_list(self.type) and pa.types.is_integer(t))

    def type_name(self) -> str:
        return str(self.type)


def _list(t: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", t, nullable=False))


LOGPROB = Check("logprob")

TOKEN_COLUMNS: tuple[Column, ...] = (
    Column("run_id", pa.string(), False, "the run", dictionary=True),
    Column("step", pa.int64(), False, "the training step: the trainer's weight version"),
    Column("rank", pa.int32(), False, "the process that wrote the row"),
    Column("sample_id", pa.int64(), False, "the response within the step (joins `samples`); default "
           "`rank * 2**32 + i`", given="sequence"),
    Column("prompt_id", pa.int64(), False, "the prompt, shared by the responses of one group", given="sequence"),
    Column("pos", pa.int32(), False, "position in the response, from 0"),
    Column("token_id", pa.int32(), False, "the sampled token (its text in `vocab`)", given="token",
           check=Check("token_id")),
    Column("mu_logprob", pa.float32(), False, "log mu: the rollout engine's log-prob of the token (or a recompute, "
           "as `run.json`'s `mu_source` says)", given="token", check=LOGPROB),
    Column("old_logprob", pa.float32(), True, "log pi_old, when the trainer recomputed it", given="token",
           check=LOGPROB),
    Column("pi_logprob", pa.float32(), False, "log pi: the trainer's log-prob in the update", given="token",
           check=LOGPROB),
    Column("advantage", pa.float32(), False, "A, the token's advantage", given="token_or_sequence",
           check=Check("finite")),
    Column("entropy", pa.float32(), True, "the trainer's entropy at the position (nats)", given="token",
           check=Check("range", -1e-5, np.inf)),
    Column("mu_topk_ids", _list(pa.int32()), True, "mu's top-K token ids (null with `log_topk=False`)",
           given="topk", check=Check("token_id"), statistics=False),
    Column("mu_topk_logprobs", _list(pa.float32()), True, "mu's log-probs at those ids", given="topk",
           check=LOGPROB, statistics=False),
    Column("pi_topk_logprobs", _list(pa.float32()), True, "pi's log-probs at the same ids", given="topk",
           check=LOGPROB, statistics=False),
    Column("topk_tv", pa.float32(), True, "top-K TV of mu and pi, computed when logged", given="token",
           check=Check("range", 0.0, 1.0 + 1e-6)),
    Column("topk_kl", pa.float32(), True, "top-K KL(mu \\|\\| pi), computed when logged", given="token",
           check=Check("range", -1e-6, np.inf)),
    Column("kept", pa.bool_(), False, "the mask the trainer applied: False where its rule blocked the token",
           given="token", check=Check("bool")),
    Column("loss_rule", pa.string(), False, "the rule the trainer applied", dictionary=True),
    Column("blocked_rules", pa.int64(), True, "written by the logger: bit i set when rule i of the file's list "
           "blocks the token ([below](#each-tokens-blocking-rules-blocked_rules))", since=2),
    Column("policy_version", pa.int64(), True, "the weight version of the engine that sampled the token (the "
           "trainer's is `step`; the views' `staleness` is `step - policy_version`); per token, so a response "
           "generated across a weight update is exact; null: unknown", given="token_or_sequence",
           check=Check("version"), since=3),
    Column("turn", pa.int32(), True, "the model turn of a multi-turn trajectory the token belongs to (0 for "
           "single-turn); never decreases along a response; null: unknown", given="token_or_sequence",
           check=Check("turn"), since=3),
    Column("engine_token_id", pa.int32(), True, "the token id the rollout engine sampled (the trainer's input is "
           "`token_id`; where they differ the history was re-tokenized: doctor check `token_drift`); null: not "
           "logged",
           given="token", check=Check("token_id"), since=3),
    Column("routing_agreement", pa.float32(), True, "mixture-of-experts models: the share of the engine's (layer, "
           "slot) expert choices the trainer's router also made in that layer, at the position predicting the token "
           "(1: routed alike in every layer); null: a dense model or not logged", given="token",
           check=Check("range", 0.0, 1.0), since=3),
    Column("engine_experts", _list(pa.int16()), True, "mixture-of-experts models: the experts the rollout engine "
           "routed the token to, L MoE layers x top-k ids flattened layer by layer (`TokenLogger(routing_shape=...)` "
           "declares L, k and the expert count); null: not logged", given="routing", statistics=False, since=3),
    Column("trainer_experts", _list(pa.int16()), True, "the same from the trainer's router: the experts its forward "
           "used (with both given, the logger fills `routing_agreement` and `routing_first_layer`); kept on a "
           "sampled share of the rows like `engine_experts` (`TokenLogger(routing_fraction=...)`, docs/moe.md), "
           "null elsewhere", given="routing", statistics=False, since=3),
    Column("update_index", pa.int32(), True, "which update of the training step trained the row, from 0 (verl: "
           "`parameter_sync_step` trigger x ppo epoch x mini-batch; TRL: iteration x `steps_per_generation`; "
           "`trustscope train`: the mini-batch); a response trained by several updates of one step has rows in "
           "each; null: unknown or a single update", given="token_or_sequence", check=Check("int", 0), since=4),
    Column("rollout_rejected", pa.bool_(), True, "True where the framework's rollout rejection sampling (verl "
           "`rollout_rs`) masked the token out of the loss (the row is logged all the same, `kept` False); null: "
           "no rejection sampling", given="token", check=Check("bool"), since=4),
    Column("is_weight", pa.float32(), True, "the rollout importance weight the framework applied to the token "
           "(verl's `rollout_is_weights`, slime's TIS); null: none", given="token_or_sequence",
           check=Check("range", 0.0, np.inf), since=4),
    Column("policy_version_last", pa.int64(), True, "the last weight version that generated part of the token's "
           "trajectory (a partial rollout spans versions; `policy_version` stays the first, or the token's own); "
           "null: unknown", given="token_or_sequence", check=Check("version"), since=4),
    Column("router_experts", _list(pa.int16()), True, "mixture-of-experts models under routing replay: the trainer "
           "router's own pick before the replay replaced it (L x top-k ids, layer by layer; with `engine_experts` the "
           "logger fills `routing_replaced`); on a sampled share of the rows like the other expert lists",
           given="routing", statistics=False, since=4),
    Column("routing_first_layer", pa.int16(), True, "the first MoE layer where the engine's and the trainer's "
           "experts differ: -1 none (full agreement), -2 the engine reported no routing for the token (a fallback); "
           "null: not both sides logged", since=4),
    Column("routing_replaced", pa.float32(), True, "routing replay: the share of the router's own (layer, slot) "
           "choices the replay replaced by the engine's (the replace rate); null: no `router_experts`, or no engine "
           "routing for the token", since=4),
    Column("routing_fault", pa.int8(), True, "routing health bits: 1 the engine reported no routing for the token "
           "(fallback), 2 its response's engine experts match the router's own pick one position off better than at "
           "their own (a shifted replay buffer), 4 its response's engine experts repeat another response's with "
           "other tokens (a reused buffer); 0 none; null: no expert lists logged", since=4),
)
"""The ``tokens`` table: one row per logged response token."""

SAMPLE_COLUMNS: tuple[Column, ...] = (
    Column("run_id", pa.string(), False, "the run", dictionary=True),
    Column("step", pa.int64(), False, "the training step"),
    Column("rank", pa.int32(), False, "the process that wrote the row"),
    Column("sample_id", pa.int64(), False, "the response (joins `tokens`)", given="sequence"),
    Column("prompt_id", pa.int64(), False, "the prompt", given="sequence"),
    Column("prompt", pa.string(), True, "prompt text", given="sequence", check=Check("text")),
    Column("response", pa.string(), True, "response text", given="sequence", check=Check("text")),
    Column("reward", pa.float32(), True, "the response's reward", given="sequence", check=Check("finite")),
    Column("advantage", pa.float32(), True, "the response's advantage", given="sequence", check=Check("finite")),
    Column("length", pa.int32(), False, "response length in tokens", given="sequence", check=Check("int", 0)),
    Column("finish_reason", pa.string(), True, "why generation stopped (`stop`, `length`, ...)", given="sequence",
           check=Check("text"), dictionary=True),
)
"""The ``samples`` table: one row per response (every response of the step, also when only a fraction of its tokens
is logged)."""

STEP_COLUMNS: tuple[Column, ...] = (
    Column("run_id", pa.string(), False, "the run", dictionary=True),
    Column("step", pa.int64(), False, "the training step"),
    Column("rank", pa.int32(), False, "the process that logged it"),
    Column("name", pa.string(), False, "the scalar's name, e.g. `reward/mean`, `trl/<name>`", dictionary=True),
    Column("value", pa.float64(), True, "its value"),
)
"""The ``steps`` table: long-form scalars (NaN and inf are kept: a NaN loss is news)."""

SUMMARY_COLUMNS: tuple[Column, ...] = (
    Column("run_id", pa.string(), False, "the run", dictionary=True),
    Column("step", pa.int64(), False, "the training step"),
    Column("rank", pa.int32(), False, "the process that wrote it"),
    Column("part", pa.int32(), False, "the first `log_step` call of (step, rank) merged into the row"),
    Column("metric", pa.string(), False, "what is aggregated: `tokens`, `blocked`, `trainer_blocked`, "
           "`bad_negative`, ...", dictionary=True),
    Column("rule", pa.string(), True, "metric `blocked`: the rule", dictionary=True),
    Column("advantage_sign", pa.string(), True, "`positive`, `negative` or `zero`", dictionary=True),
    Column("mu_low", pa.float64(), True, "lower edge of the mu bucket (SQL macro `mu_bucket`)"),
    Column("bin_low", pa.float64(), True, "histogram rows: the bin `[bin_low, bin_high)`"),
    Column("bin_high", pa.float64(), True, "histogram rows: the bin's upper edge"),
    Column("threshold", pa.float64(), True, "metric `bad_negative`: the delta used"),
    Column("count", pa.int64(), False, "tokens counted"),
    Column("sum", pa.float64(), True, "sum of the values"),
    Column("sum_sq", pa.float64(), True, "sum of their squares"),
    Column("min", pa.float64(), True, "smallest value"),
    Column("max", pa.float64(), True, "largest value"),
    Column("dimension", pa.string(), True, "null: the row belongs to the advantage sign x mu bucket grouping; else "
           "the summary dimension it splits by (`position`, `turn`, `staleness`; `layer`: metric `routing_agreement` per MoE "
           "layer)", since=2, dictionary=True),
    Column("bucket", pa.int64(), True, "rows with a `dimension`: the bucket's lower edge (position: 0, 1, 2, 4, "
           "...; turn and staleness: the value)", since=2),
)
"""The ``summaries`` table: exact per-step aggregates over every token handed to ``log_step`` (whatever
``token_fraction`` keeps); see :mod:`trustscope.logger.summaries`."""

VOCAB_COLUMNS: tuple[Column, ...] = (
    Column("token_id", pa.int32(), False, "the id"),
    Column("text", pa.string(), True, "its decoded text"),
)
"""The ``vocab`` table: token id -> decoded text, so statistics can name tokens."""

TABLE_COLUMNS: dict[str, tuple[Column, ...]] = {
    "tokens": TOKEN_COLUMNS, "samples": SAMPLE_COLUMNS, "steps": STEP_COLUMNS, "summaries": SUMMARY_COLUMNS,
    "vocab": VOCAB_COLUMNS,
}


def arrow_schema(columns: tuple[Column, ...]) -> pa.Schema:
    return pa.schema([c.field for c in columns])


def column(table: str, name: str) -> Column:
    """The declared column ``name`` of ``table``; KeyError names the table's columns."""
    for c in TABLE_COLUMNS[table]:
        if c.name == name:
            return c
    raise KeyError(f"table {table!r} has no column {name!r}; it has {[c.name for c in TABLE_COLUMNS[table]]}")


def table_versions() -> dict[str, int]:
    """The tables some column was added to after the first version, and their current version."""
    return {t: max(c.since for c in cols) for t, cols in TABLE_COLUMNS.items() if max(c.since for c in cols) > 1}


def added_columns() -> dict[str, frozenset[str]]:
    """Per table, the columns added by a later table version: files written before lack them (read as NULL)."""
    return {t: frozenset(c.name for c in cols if c.since > 1) for t, cols in TABLE_COLUMNS.items()
            if any(c.since > 1 for c in cols)}


# ------------------------------------------------------------------------------------------------- user columns

EXTRA_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(), "bool": pa.bool_(), "int32": pa.int32(), "int64": pa.int64(),
    "float32": pa.float32(), "float64": pa.float64(), "list<int32>": _list(pa.int32()),
    "list<float32>": _list(pa.float32()),
}
"""The types a run's own columns may have (``extra_columns={"env": "string", "tool_latency": "float32"}``); a
list type takes a list per token, ``(B, T, L)``."""

VIEW_COLUMNS = ("source_file", "staleness", "position_bucket", "mu_prob", "old_prob", "pi_prob", "prob_diff",
                "log_ratio", "ratio", "binary_tv", "binary_kl", "advantage_sign", "mu_bucket", "entropy_bucket",
                "token_text", "seq_pos", "rule_set")
"""Columns the tokens views derive; a run's own column may not take one of these names either (nor ``blocks_*``)."""

_EXTRA_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


def _extra_check(t: pa.DataType) -> Check:
    t = t.value_type if pa.types.is_list(t) else t
    if pa.types.is_string(t):
        return Check("text")
    if pa.types.is_boolean(t):
        return Check("bool")
    if pa.types.is_integer(t):
        return Check("int")
    return Check("finite")


def extra_columns(declared: Mapping[str, str] | None) -> tuple[Column, ...]:
    """The :class:`Column` of each of a run's own per-token columns, ``{name: type}`` with a type of
    :data:`EXTRA_TYPES`. Raises ValueError naming the column: a name that is not a lowercase SQL identifier, or that
    shadows a built-in column of any table or a column the views derive, or an unknown type."""
    if declared is None:
        return ()
    if not isinstance(declared, Mapping):
        raise ValueError(f"extra_columns must be a mapping of column name -> type, got {declared!r}")
    builtin = {c.name for cols in TABLE_COLUMNS.values() for c in cols} | set(VIEW_COLUMNS)
    out = []
    for name, kind in declared.items():
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
            raise ValueError(f"extra_columns: column name {name!r} must be a lowercase identifier ([a-z][a-z0-9_]*, "
                             f"at most 63 characters)")
        if name in builtin or name.startswith("blocks_"):
            raise ValueError(f"extra_columns: column {name!r} shadows a built-in column of that name; pick another")
        if kind not in EXTRA_TYPES:
            raise ValueError(f"extra_columns[{name!r}]: type {kind!r} is not one of {list(EXTRA_TYPES)}")
        t = EXTRA_TYPES[kind]
        out.append(Column(name, t, True, f"declared by the run ({kind})",
                          given="token_list" if pa.types.is_list(t) else "token_or_sequence",
                          check=_extra_check(t), dictionary=pa.types.is_string(t)))
    return tuple(out)


def builtin_token_columns_sql() -> str:
    """The built-in tokens columns as SQL string literals (``'run_id', 'step', ...``), for the views that pass a
    run's own columns through (``columns(lambda c: not list_contains([...], c))``): identifiers from
    :data:`TOKEN_COLUMNS` and :data:`VIEW_COLUMNS`, never user input."""
    names = [c.name for c in TOKEN_COLUMNS] + list(VIEW_COLUMNS)
    for name in names:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"{name!r} is not a plain identifier")
    return ", ".join(f"'{name}'" for name in names)


def dimension_columns_sql() -> str:
    """The token columns the summary dimensions read beyond ``rule_blocks``' own (``turn, policy_version``), for
    the ``token_dimensions`` view: identifiers from :data:`DIMENSIONS`, never user input."""
    names = [n for d in DIMENSIONS for n in d.needs if n != "pos"]
    for name in names:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"{name!r} is not a plain identifier")
    return ", ".join(dict.fromkeys(names))


def dimension_buckets_sql(source: str = "tokens") -> str:
    """Every token row of ``source`` once per summary dimension it has (its :data:`DIMENSIONS` columns not null),
    with the dimension's name and its bucket from the dimension's SQL: the ``token_dimensions`` view's union."""
    parts = []
    for d in DIMENSIONS:
        present = " and ".join(f"{n} is not null" for n in d.needs)
        parts.append(f"select *, '{d.name}' as dimension, ({d.sql})::bigint as bucket from {source} where {present}")
    return "\n    union all by name\n    ".join(parts)


def turns_from_mask(mask: np.ndarray) -> np.ndarray:
    """``(B, T)`` int32: the model turn of each position of ``mask`` ``(B, T)`` (or ``(T,)``), a response mask
    False on the tokens the model did not sample (a tool's or environment's answer spliced into a multi-turn
    trajectory): 0 up to the first gap, 1 after it, ...; a response without a gap is all 0. How the integrations
    and importers fill ``turn`` where the source keeps no turn of its own."""
    m = np.asarray(mask, dtype=bool)
    starts = m.copy()  # the first token of each run of model tokens
    starts[..., 1:] &= ~m[..., :-1]
    return np.maximum(np.cumsum(starts, axis=-1) - 1, 0).astype(np.int32)


# --------------------------------------------------------------------------------------------- summary dimensions


def position_bucket(pos: np.ndarray) -> np.ndarray:
    """``(N,)`` the lower edge of each position's power-of-two bucket: 0, 1, 2 (2-3), 4 (4-7), 8 (8-15), ..."""
    pos = np.asarray(pos, dtype=np.int64)
    _, exp = np.frexp(np.maximum(pos, 1).astype(np.float64))  # pos = m * 2**exp, m in [0.5, 1): exact for ints
    return np.where(pos < 1, 0, np.left_shift(np.int64(1), (exp - 1).astype(np.int64)))


@dataclass(frozen=True)
class Dimension:
    """A dimension of the exact summaries: each token's bucket, in numpy and in SQL."""

    name: str
    doc: str
    needs: tuple[str, ...]
    """The token columns the bucket reads; a call (or a run) without them has no rows of this dimension."""
    bucket: Callable[[Mapping[str, np.ndarray], int], np.ndarray]
    """``(cols, step) -> (N,) int64`` bucket of each token row (its lower edge)."""
    sql: str
    """The same bucket as a SQL expression over the tokens views' columns (the views label a bucket with the macro
    ``bucket_label(dimension, bucket)``)."""


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("position", "the token's position in the response, in power-of-two buckets (0, 1, 2-3, 4-7, ...)",
              ("pos",), lambda cols, step: position_bucket(cols["pos"]), "position_bucket(pos)"),
    Dimension("turn", "the model turn of a multi-turn trajectory (tokens logged without `turn` have none)",
              ("turn",), lambda cols, step: np.asarray(cols["turn"], dtype=np.int64), "turn"),
    Dimension("staleness", "`step - policy_version`: how many weight updates the sampling engine was behind "
              "(tokens logged without `policy_version` have none)", ("policy_version",),
              lambda cols, step: np.int64(step) - np.asarray(cols["policy_version"], dtype=np.int64),
              "step - policy_version"),
    Dimension("routing", "mixture-of-experts runs: the first MoE layer where the engine's and the trainer's experts "
              "differ (-1: every choice agrees; -2: the engine reported no routing)", ("routing_first_layer",),
              lambda cols, step: np.asarray(cols["routing_first_layer"], dtype=np.int64), "routing_first_layer"),
)
"""The summary dimensions, each on its own beside the advantage sign x mu bucket grouping (never crossed)."""


def dimension(name: str) -> Dimension:
    for d in DIMENSIONS:
        if d.name == name:
            return d
    raise KeyError(f"no summary dimension {name!r}; there are {[d.name for d in DIMENSIONS]}")


def columns_markdown(table: str) -> str:
    """``docs/logging.md``'s table of ``table``'s columns (a generated block, checked by ``tests/test_docs.py``)."""
    lines = ["| column | type | nullable | what it holds |", "|---|---|---|---|"]
    for c in TABLE_COLUMNS[table]:
        doc = c.doc + (f" (added in tokens version {c.since}: older files read NULL)" if c.since > 1 and
                       table == "tokens" and c.name != "blocked_rules" else "")
        lines.append(f"| `{c.name}` | `{c.type_name()}` | {'yes' if c.nullable else 'no'} | {doc} |")
    return "\n".join(lines) + "\n"


def dimensions_markdown() -> str:
    """``docs/logging.md``'s table of the summary dimensions (a generated block)."""
    lines = ["| dimension | bucket | SQL |", "|---|---|---|"]
    for d in DIMENSIONS:
        lines.append(f"| `{d.name}` | {d.doc} | `{d.sql}` |")
    return "\n".join(lines) + "\n"
