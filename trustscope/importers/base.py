"""Shared base of the importers: the registry (:func:`register_importer`, the :class:`Importer` protocol), and
parsed sequences -> one trustscope run, written all or nothing.

Every importer reads its framework's files (all, or the steps asked for) into :class:`ImportedRun` (one
:class:`Sequence` per response, scalars per step) and raises :class:`ImportFormatError` naming the file and line
(or tensor key) at the first thing that does not match the writer's format. :func:`write_steps` writes the parts
of a source (its steps read one by one on worker processes, :func:`read_steps`, for a format that lists its
steps; else the whole source, :func:`write_run`) through :class:`~trustscope.logger.TokenLogger`'s public API,
each part checked before any of its rows is logged, into a hidden temporary directory inside the log directory,
and renames the finished run directory into place. A failure at any point removes the temporary directory, so the
target log directory never holds a partial import.

Fields a writer's known layout does not have are kept on each sequence (:func:`keep_unknown`) and become the
run's own columns (``extra_columns``) where a column takes them; :func:`name_unknown` names them once.

Unscored tokens (a NaN or null log-prob, entropy or advantage on a trained position: the frameworks write those
where the engine or trainer returned nothing finite) are left out of the token table and counted in ``run.json``
(``config.import.unscored_tokens``), the same way a trainer's own mask leaves tokens out.

Routed experts (a mixture-of-experts run whose source keeps the engine's, :attr:`Sequence.engine_experts`) become
the ``engine_experts`` column, the run declared with ``routing_shape`` (:func:`routing_shape`); the sources hold
the engine's side only, so no ``trainer_experts`` and no agreement.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import secrets
import shutil
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import orjson

from trustscope.columns import turns_from_mask
from trustscope.runformat.layout import LOGPROB_TOLERANCE

__all__ = ["IMPORTERS", "ImportFormat", "ImportFormatError", "ImportUsageError", "ImportedRun", "Importer",
           "Listing", "SameThroughout", "Sequence", "SourceGone", "checked_options", "combine", "format_for",
           "json_lines", "keep_unknown", "log_step", "name_unknown", "read_steps", "register_importer", "unscored",
           "write_run", "write_steps"]


class ImportFormatError(ValueError):
    """A source file that does not match its writer's format. The message starts with the file (and line or key)."""


class ImportUsageError(ValueError):
    """A format no importer is registered for, or an option the format does not take."""


class SourceGone(ImportFormatError):
    """A followed source that disappeared."""


@dataclass(frozen=True)
class Listing:
    """What a poll of a followed source found: every step it holds, and those whose writer has finished them."""

    steps: frozenset[int]
    finished: frozenset[int]


class Importer(Protocol):
    """An importer: parses and checks a whole source (a file or a directory) into an :class:`ImportedRun`, or raises
    :class:`ImportFormatError` naming the file and line (or tensor key) of the first thing that does not match.
    ``version`` is the framework version the caller knows (the files record none); ``steps``, when given, are
    the only steps read (a followed source: the files of other steps may be half written, and side streams that
    are still being appended to end at their last complete line). An importer may take more
    keyword flags, each with a default, which it declares in :func:`register_importer`'s ``options``."""

    def __call__(self, src: Path, *, version: str | None = None, steps: Collection[int] | None = None
                 ) -> ImportedRun: ...


@dataclass(frozen=True)
class ImportFormat:
    """One registered format: its name (``trustscope import NAME``), its importer, what it reads (one line, for
    the help and the docs) and the options it takes (keyword name -> what it does)."""

    name: str
    read: Importer
    reads: str
    options: Mapping[str, str] = field(default_factory=dict)
    steps: Callable[..., list[int]] | None = None
    """``steps(src, **options)``: the steps the source holds, listed without parsing them (refusing a source with
    none as ``read`` does). A format that has it is imported step by step (:func:`import_steps`): each step read on
    a worker process, in bounded memory; one that has none is read whole, then written."""
    combine: Callable[[ImportedRun, ImportedRun], ImportedRun] | None = None
    """``combine(so_far, step)``: the run's description (format, version, notes, loss rule, unknown fields) from
    the steps read so far and the next one, refusing what the steps must agree on; default :func:`combine`."""
    finished: Callable[[Path, float, float], Listing] | None = None
    """``finished(src, settle_s, now)``: the steps of a source still being written and those its writer has
    finished (:class:`Listing`; :class:`SourceGone` when the source is gone); a format that has it can be followed
    (``trustscope import --follow``, :mod:`trustscope.importers.follow`)."""


IMPORTERS: dict[str, ImportFormat] = {}
"""Every registered format by name, in the order registered; :mod:`trustscope.importers` registers the built-in
ones."""


def register_importer(name: str, *, reads: str, options: Mapping[str, str] | None = None,
                      steps: Callable[..., list[int]] | None = None,
                      combine: Callable[[ImportedRun, ImportedRun], ImportedRun] | None = None,
                      finished: Callable[[Path, float, float], Listing] | None = None
                      ) -> Callable[[Importer], Importer]:
    """Register the decorated function as the importer of format ``name``.

    ``reads``: what the format's files are, in one line (``trustscope import --help`` lists it). ``options``: the
    keyword flags the importer takes beyond ``version``, each with what it does (the CLI's ``--allow-pickle`` is
    ``allow_pickle``); an option given for a format that does not declare it is refused. ``steps``, ``combine``
    and ``finished``: see :class:`ImportFormat`.
    """

    def add(read: Importer) -> Importer:
        if name in IMPORTERS:
            raise ValueError(f"import format {name!r} is registered twice")
        IMPORTERS[name] = ImportFormat(name, read, reads, dict(options or {}), steps, combine, finished)
        return read

    return add


def format_for(name: str) -> ImportFormat:
    """The registered format ``name``; :class:`ImportUsageError` listing the known ones when there is none."""
    if name not in IMPORTERS:
        raise ImportUsageError(f"unknown format {name!r}; known: {', '.join(IMPORTERS)}")
    return IMPORTERS[name]


def checked_options(fmt: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``options`` that are set (not ``None`` or ``False``); :class:`ImportUsageError` when format
    ``fmt`` does not take one of them, naming the formats that do."""
    importer = format_for(fmt)
    given = {name: value for name, value in options.items() if value not in (None, False)}
    foreign = sorted(set(given) - set(importer.options))
    if foreign:
        takers = {name: [f.name for f in IMPORTERS.values() if name in f.options] for name in foreign}
        raise ImportUsageError(f"format {fmt!r} takes no option {', '.join(foreign)} ("
                               + "; ".join(f"{name}: {', '.join(fs) or 'no format'}" for name, fs in takers.items())
                               + ")")
    return given


T = TypeVar("T")


class SameThroughout(Generic[T]):
    """What every file of one source must agree on (a layout, a key set, a writer's version): files written by two
    versions or configurations of a framework must not end up in one run.

    :meth:`check` remembers the first value and where it was seen; a different one later is refused, naming both
    places, each value as ``describe`` words it, and what is ``mixed``.
    """

    def __init__(self, mixed: str, describe: Callable[[T], str] = str):
        self.mixed, self.describe = mixed, describe
        self.first: tuple[T, str] | None = None

    def check(self, value: T, where: str) -> None:
        """Refuse ``value`` (found at ``where``) when it differs from the first value checked."""
        if self.first is None:
            self.first = (value, where)
        elif value != self.first[0]:
            first, first_where = self.first
            raise ImportFormatError(f"{where}: {self.describe(value)}, unlike {first_where} "
                                    f"({self.describe(first)}): {self.mixed}")

    @property
    def value(self) -> T | None:
        """The value every file checked so far has, or None before the first."""
        return None if self.first is None else self.first[0]


@dataclass
class Sequence:
    """One response of one step, in the source's own alignment (all per-token arrays ``(T,)``, aligned).

    ``mask`` marks the positions the trainer trained on (real generated tokens); positions outside it (tool
    output, padding inside a multi-turn span) keep their index, so ``pos`` in the token table is the offset from
    the first generated token. NaN in a float array marks an unscored token.
    """

    step: int
    rank: int
    where: str  # "file:line" or "file[key]", for error messages
    token_id: np.ndarray  # (T,) int
    mu_logprob: np.ndarray  # (T,) float32: the rollout engine's log-prob
    pi_logprob: np.ndarray  # (T,) float32: the trainer's log-prob (which one: ImportedRun.notes)
    advantage: np.ndarray  # (T,) float32
    mask: np.ndarray  # (T,) bool
    old_logprob: np.ndarray | None = None  # (T,) float32
    entropy: np.ndarray | None = None  # (T,) float32
    kept: np.ndarray | None = None  # (T,) bool: the trainer's own trust-region mask, when the source has one
    prompt_key: Any = None  # equal keys within a step share a prompt_id (e.g. the prompt's token ids)
    sample_id: int | None = None  # the source's own id when it has a unique one per step
    prompt: str | None = None
    response: str | None = None
    reward: float | None = None
    finish_reason: str | None = None
    full_ids: np.ndarray | None = None  # (L,) the source's whole token sequence, to join other streams by
    engine_experts: np.ndarray | None = None  # (T, L, k) int: the engine's experts at the position predicting
    # each token (the row of the position before it); -1 where the source recorded none
    policy_version: int | None = None  # the weight version (a trainer step) that generated the response's start
    policy_version_last: int | None = None  # the last one that generated part of it (a partial rollout spans several)
    extra: dict[str, Any] = field(default_factory=dict)  # fields trustscope does not know, kept: (T,) or a scalar


@dataclass
class ImportedRun:
    """Everything one source holds, parsed and checked, ready for :func:`write_run`."""

    framework: str
    version: str  # the framework version, or what the files say of the writer when they record none
    format: str  # the file layout that was read, e.g. "token_export schema_version 1, weight-stream layout"
    src: Path
    loss_rule: str
    notes: dict[str, str]  # what each trustscope column was filled from
    sequences: list[Sequence] = field(default_factory=list)
    scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    files: int = 0
    unknown: dict[str, str] = field(default_factory=dict)
    """Fields trustscope does not know -> where each was first seen (named once, :func:`name_unknown`)."""
    extra_types: dict[str, str] = field(default_factory=dict)
    """The unknown fields kept as the run's own columns -> their type (:data:`trustscope.columns.EXTRA_TYPES`);
    the others of ``unknown`` are left out, :attr:`skipped` says why."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Unknown fields left out -> why (a type no column takes)."""
    stats: Any = None
    """What a format's ``combine`` adds up over the steps (its own record; None for the default)."""
    routing: tuple[int, int] | None = None
    """``(MoE layers, top-k)`` of the sequences' ``engine_experts``, when the source holds routed experts."""


def raw_lines(path: Path, partial_tail: bool = False) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` for each line of a JSONL file; a truncated last line is an error.

    ``partial_tail``: a file another process is still appending to; its last line without a newline is not
    written yet and is left out instead of refused."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                if partial_tail:
                    return
                raise ImportFormatError(f"{path}:{number}: last line has no newline: the file is truncated "
                                        f"(the writer ends every record with one)")
            yield number, raw


def loads(raw: bytes, where: str) -> Any:
    """One JSON line parsed; an unparsable line is an error naming ``where``.

    Parsed by orjson (about 9x faster than ``json`` on token-export lines); a line orjson refuses is parsed again
    by Python's ``json``, which also accepts the bare ``NaN`` / ``Infinity`` that ``json.dumps`` writes by default.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _loads_python(raw, where)


def json_lines(path: Path, partial_tail: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)`` for each line of a JSONL file (:func:`raw_lines`, :func:`loads`)."""
    for number, raw in raw_lines(path, partial_tail):
        yield number, loads(raw, f"{path}:{number}")


def _loads_python(raw: bytes, where: str) -> Any:
    """Python's ``json`` on a line orjson refused (bare NaN / Infinity), or the error naming the line."""
    if not raw.strip():
        raise ImportFormatError(f"{where}: empty line")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ImportFormatError(f"{where}: not valid JSON ({err})") from None


def floats(values: Any, where: str, name: str) -> np.ndarray:
    """A JSON list of numbers (null = unscored) as float32 ``(T,)``, nulls as NaN."""
    if not isinstance(values, list):
        raise ImportFormatError(f"{where}: {name!r} must be a list, got {type(values).__name__}")
    if values and values[0] is None and values.count(None) == len(values):  # a stream the writer left unset
        return np.full(len(values), np.nan, dtype=np.float32)
    try:
        return np.array(values, dtype=np.float32)  # None -> NaN
    except (TypeError, ValueError):
        bad = next(v for v in values if not isinstance(v, (int, float)) and v is not None)
        raise ImportFormatError(f"{where}: {name!r} holds a non-number {bad!r}") from None


def ints(values: Any, where: str, name: str) -> np.ndarray:
    """A JSON list of integers as int64 ``(T,)``."""
    arr = np.array(values) if isinstance(values, list) else None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind != "i"):  # bools, floats, nulls, text
        raise ImportFormatError(f"{where}: {name!r} must be a list of integers")
    return arr.astype(np.int64, copy=False)


def check_values(seq: Sequence, vocab_size: int | None = None) -> None:
    """Reject values no writer produces on trained positions (positive log-probs, negative entropy, token ids
    outside int32 or the tokenizer's vocabulary), naming the sequence's file and line, before anything is written."""
    ids = ("token_id", 0, 2**31 - 1, "token ids are in [0, 2^31)") if vocab_size is None else \
        ("token_id", 0, vocab_size - 1, f"the tokenizer has {vocab_size} tokens (is it the run's tokenizer?)")
    limits = (("mu_logprob", -np.inf, LOGPROB_TOLERANCE, "a log-probability is <= 0"),
              ("pi_logprob", -np.inf, LOGPROB_TOLERANCE, "a log-probability is <= 0"),
              ("old_logprob", -np.inf, LOGPROB_TOLERANCE, "a log-probability is <= 0"),
              ("entropy", -LOGPROB_TOLERANCE, np.inf, "an entropy is >= 0"), ids)
    for name, low, high, why in limits:
        arr = getattr(seq, name)
        if arr is None:
            continue
        bad = seq.mask & ((arr < low) | (arr > high))
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise ImportFormatError(f"{seq.where}: {name} {arr[pos].item()} at response position {pos}: {why}")


def _scored(seq: Sequence) -> np.ndarray:
    """``mask`` minus the unscored positions (NaN in any float column)."""
    ok = seq.mask.copy()
    for arr in (seq.mu_logprob, seq.pi_logprob, seq.advantage, seq.old_logprob, seq.entropy):
        if arr is not None:
            ok &= np.isfinite(arr)
    return ok


_NUMPY_TYPES = {"bool": np.bool_, "int64": np.int64, "float64": np.float64, "string": object}


def extra_value(value: Any, n: int) -> tuple[str | None, Any]:
    """How a field trustscope does not know can be kept: ``(type, value)`` with a type of
    :data:`trustscope.columns.EXTRA_TYPES` and the value as a ``(n,)`` array (a list aligned with the ``n``
    tokens) or a scalar (one per sequence, broadcast over its tokens); ``(None, why)`` when no column takes it.

    Numbers are ``int64`` when all are integers, else ``float64`` (null: NaN); booleans ``bool``; text
    ``string`` (null: None). A scalar null is ``(None, None)``: the type is not known from it."""
    if isinstance(value, list):
        if len(value) != n:
            return None, f"a list of {len(value)} values, not one per token ({n})"
        kinds = {type(v) for v in value}
        if kinds <= {bool}:
            return "bool", np.array(value, dtype=bool)
        if kinds <= {int}:
            try:
                return "int64", np.array(value, dtype=np.int64)
            except OverflowError:
                return None, "integers beyond int64"
        if kinds <= {int, float, type(None)}:
            return "float64", np.array(value, dtype=np.float64)
        if kinds <= {str, type(None)}:
            arr = np.empty(n, dtype=object)
            arr[:] = value
            return "string", arr
        return None, "a list of " + "/".join(sorted(k.__name__ for k in kinds)) + " values"
    if value is None:
        return None, None
    if type(value) is int and not -2**63 <= value < 2**63:
        return None, "an integer beyond int64"
    for kind, types in (("bool", bool), ("int64", int), ("float64", float), ("string", str)):
        if type(value) is types:
            return kind, value
    return None, f"a {type(value).__name__}"


def keep_unknown(run: ImportedRun, seq: Sequence, record: Mapping[str, Any], names: Collection[str], n: int,
                 span: slice, where: str) -> None:
    """Keep the fields ``names`` of ``record`` (fields trustscope does not know; per-token lists have ``n``
    values) on ``seq`` (per-token values cut to ``span``) and note each in ``run``: its type, or why it is left
    out. A field whose type changes between records is refused, naming the record."""
    from trustscope.columns import extra_columns

    for name in names:
        run.unknown.setdefault(name, where)
        if name in run.skipped:
            continue
        kind, value = extra_value(record[name], n)
        if kind is None:
            if value is not None:
                run.skipped[name] = value
            continue
        had = run.extra_types.get(name)
        if had is None:
            try:
                extra_columns({name: kind})
            except ValueError as err:
                run.skipped[name] = ("trustscope has a column of that name" if "shadows" in str(err) else
                                     "not a column name: lowercase letters, digits and _, from a letter")
                continue
            run.extra_types[name] = had = kind
        elif had != kind and {had, kind} == {"int64", "float64"}:
            run.extra_types[name] = had = "float64"  # integers so far, now fractions: all as float64
        elif had != kind:
            raise ImportFormatError(f"{where}: field {name!r} holds {kind} values, earlier records {had}")
        seq.extra[name] = value[span] if isinstance(value, np.ndarray) else value


def _extra_parts(seqs: list[Sequence], name: str, kind: str, masks: list[np.ndarray]) -> list[np.ndarray] | None:
    """Column ``name`` (declared ``kind``) of each sequence as a ``(T,)`` array, a scalar broadcast and a
    missing value null; None when a scored token would hold a null number (no numeric column takes one: the
    column is left out of the call, so its rows read NULL)."""
    dtype = _NUMPY_TYPES[kind]
    parts = []
    for seq, keep in zip(seqs, masks, strict=True):
        value = seq.extra.get(name)
        n = len(seq.token_id)
        if isinstance(value, np.ndarray):
            if kind == "int64" and value.dtype.kind == "f":
                if not np.isfinite(value[keep]).all():
                    return None
                value = np.where(keep, value, 0.0)
                if (value != np.round(value)).any():
                    raise ImportFormatError(f"{seq.where}: field {name!r} holds fractions, earlier records "
                                            f"integers only")
            part = value.astype(dtype, copy=False)
        else:
            if value is None and kind != "string":
                if keep.any():
                    return None
                value = 0
            part = np.full(n, value, dtype=dtype)
        if part.dtype.kind == "f" and not np.isfinite(part[keep]).all():
            return None
        parts.append(part)
    return parts


def _step_call(seqs: list[Sequence], sample_ids: list[int], prompt_ids: list[int],
               extra_types: Mapping[str, str], routing: bool = False) -> tuple[dict, list, dict, list[str]]:
    """The ragged ``tokens``, ``mask`` and ``samples`` arguments of one ``log_step`` call (each per-token column
    a list of the sequences' own arrays: nothing padded), and the extra columns left out of it (nulls).
    ``routing``: the call carries the sequences' ``engine_experts``."""
    masks = [_scored(s) for s in seqs]
    tokens: dict[str, Any] = {
        "token_id": [s.token_id for s in seqs],
        "mu_logprob": [s.mu_logprob for s in seqs],
        "pi_logprob": [s.pi_logprob for s in seqs],
        "advantage": [s.advantage for s in seqs],
        "turn": [turns_from_mask(s.mask) for s in seqs],  # a new model turn after each gap in the trained positions
        "sample_id": np.array(sample_ids, dtype=np.int64),
        "prompt_id": np.array(prompt_ids, dtype=np.int64),
    }
    for name in ("old_logprob", "entropy"):
        if all(getattr(s, name) is not None for s in seqs):
            tokens[name] = [getattr(s, name) for s in seqs]
    if any(s.kept is not None for s in seqs):
        tokens["kept"] = [s.kept if s.kept is not None else np.ones(len(s.token_id), dtype=bool) for s in seqs]
    for name in ("policy_version", "policy_version_last"):  # per sequence, when every sequence has one
        if all(getattr(s, name) is not None for s in seqs):
            tokens[name] = np.array([getattr(s, name) for s in seqs], dtype=np.int64)
    nulled = []
    if routing:
        tokens["engine_experts"] = [s.engine_experts for s in seqs]
    for name, kind in extra_types.items():
        parts = _extra_parts(seqs, name, kind, masks)
        if parts is None:
            nulled.append(name)
        else:
            tokens[name] = parts
    samples: dict[str, Any] = {
        "sample_id": sample_ids,
        "prompt_id": prompt_ids,
        "prompt": [s.prompt for s in seqs],
        "response": [s.response for s in seqs],
        "finish_reason": [s.finish_reason for s in seqs],
    }
    rewards = [s.reward for s in seqs]
    if all(r is not None and np.isfinite(r) for r in rewards):  # the samples table takes all or none per call
        samples["reward"] = rewards
    return tokens, masks, samples, nulled


def _ids(seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """Sample ids (the source's own when every sequence of the step has a unique one, else their order) and
    prompt ids (one per distinct ``prompt_key``, in order of first appearance) of one step's sequences."""
    own = [s.sample_id for s in seqs]
    if None in own or len(set(own)) != len(own):
        own = list(range(len(seqs)))
    prompts: dict[Any, int] = {}
    prompt_ids = [prompts.setdefault(s.prompt_key if s.prompt_key is not None else ("sample", i), len(prompts))
                  for i, s in enumerate(seqs)]
    return own, prompt_ids


def log_step(loggers: Mapping[int, Any], step: int, seqs: list[Sequence], scalars: Mapping[str, float] | None,
             ranks: Collection[int] | None = None, extra_types: Mapping[str, str] | None = None,
             loss_rule: str | None = None, routing: bool = False) -> list[str]:
    """Log one step's sequences (each source rank through its own logger of ``loggers``) and scalars (rank 0's
    logger), one ``log_step`` call per rank, so no flush ever holds part of a rank's share of the step.
    ``ranks``: only these ranks' share (a followed run, whose ranks commit one after the other); None, all.
    ``extra_types``: the run's own columns (the loggers' ``extra_columns``) filled from ``Sequence.extra``.
    ``routing``: the loggers declare ``routing_shape``; the step's ``engine_experts`` are logged when every
    sequence has them on every scored token, else left out (NULL) and named among the columns left out.
    Returns the extra columns some call left out (a null number on a scored token)."""
    seqs = sorted(seqs, key=lambda s: s.rank)
    sample_ids, prompt_ids = _ids(seqs)  # over the whole step, whichever ranks are logged
    present = {s.rank for s in seqs}
    nulled: list[str] = []
    if routing and not all(s.engine_experts is not None and (s.engine_experts[_scored(s)] >= 0).all()
                           for s in seqs):
        routing = False
        nulled.append("engine_experts")
    for rank in sorted(present | ({0} if scalars else set())):
        if ranks is not None and rank not in ranks:
            continue
        kwargs: dict[str, Any] = {"scalars": scalars} if rank == 0 and scalars else {}
        if rank in present:
            idx = [i for i, s in enumerate(seqs) if s.rank == rank]
            kwargs["tokens"], kwargs["mask"], kwargs["samples"], left = _step_call(
                [seqs[i] for i in idx], [sample_ids[i] for i in idx], [prompt_ids[i] for i in idx],
                extra_types or {}, routing)
            nulled += [name for name in left if name not in nulled]
        loggers[rank].log_step(step, loss_rule=loss_rule, **kwargs)
    return nulled


def unscored(seqs: list[Sequence]) -> int:
    """Trained tokens left out as unscored (a NaN log-prob, advantage or entropy)."""
    return int(sum(int((s.mask & ~_scored(s)).sum()) for s in seqs))


def combine(so_far: ImportedRun, step: ImportedRun) -> ImportedRun:
    """The default ``combine`` of a format read step by step: the first step's description (format, version,
    notes, loss rule), the files added up, the unknown fields of both; a step of another file layout (``format``
    up to its first ``;``) is refused, naming where."""
    layout, other = so_far.format.split(";")[0], step.format.split(";")[0]
    if layout != other:
        where = step.sequences[0].where if step.sequences else str(step.src)
        raise ImportFormatError(f"{where}: {other}, unlike the steps before ({layout}): a run does not mix writer "
                                f"versions")
    merged = dataclasses.replace(so_far, sequences=[], scalars={}, files=so_far.files + step.files,
                                 unknown=dict(so_far.unknown), extra_types=dict(so_far.extra_types),
                                 skipped=dict(so_far.skipped))
    merge_unknown(merged, step)
    return merged


def merge_unknown(into: ImportedRun, step: ImportedRun) -> None:
    """Add ``step``'s unknown fields to ``into``'s: where each was first seen, its type (integers and fractions
    make float64), or why it is left out."""
    for name, where in step.unknown.items():
        into.unknown.setdefault(name, where)
    for name, why in step.skipped.items():
        if name not in into.extra_types:
            into.skipped.setdefault(name, why)
    for name, kind in step.extra_types.items():
        had = into.extra_types.get(name)
        if had is None and name not in into.skipped:
            into.extra_types[name] = kind
        elif had is not None and had != kind and {had, kind} == {"int64", "float64"}:
            into.extra_types[name] = "float64"


def name_unknown(run: ImportedRun, declared: Mapping[str, str] | None = None) -> str | None:
    """The one line that names ``run``'s unknown fields (None when there are none): those kept as the run's own
    columns (``declared``: the columns the run has, default ``run.extra_types``) with their types, and those left
    out with why; also warned as an :class:`ImportWarning`."""
    if not run.unknown:
        return None
    declared = dict(run.extra_types if declared is None else declared)
    first = next(iter(run.unknown))  # the first seen
    kept = [f"{n} ({t})" for n, t in declared.items() if n in run.unknown]
    left = {n: run.skipped.get(n, "first seen after the run's columns were declared")
            for n in sorted(run.unknown) if n not in declared}
    words = [f"{run.src}: {run.framework} fields trustscope does not know (first at {run.unknown[first]}):"]
    if kept:
        words.append(f"kept as the run's own columns: {', '.join(kept)}")
    if left:
        words.append("left out: " + "; ".join(f"{n} ({why})" for n, why in left.items()))
    line = " ".join(words[:1]) + " " + "; ".join(words[1:])
    warnings.warn(line, ImportWarning, stacklevel=3)
    return line


def _read_step(fmt: str, src: Path, version: str | None, step: int, options: Mapping[str, Any]) -> ImportedRun:
    """One step of ``src``, on a worker process (its own warnings are the combined run's, named once there)."""
    import trustscope.importers  # noqa: F401  (a spawned worker registers the formats here)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)
        run = IMPORTERS[fmt].read(src, version=version, steps={step}, **options)
    for seq in run.sequences:  # joined to the other streams already: not sent back
        seq.full_ids = None
    return run


def default_workers() -> int:
    """Worker processes that parse steps while the importing process writes: the cores this process may use that
    other work leaves idle (the cores minus the 1-minute load average), at most 4; 1 (read in the importing
    process) when none is. On busy cores a worker only adds its start and each step's transfer (measured in
    ``docs/performance.md``, "Importers")."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available here
        load = 0.0
    return max(1, min(4, int(cores - load)))


def read_steps(fmt: str, src: Path, *, version: str | None = None, workers: int | None = None,
               options: Mapping[str, Any] | None = None) -> Iterator[ImportedRun]:
    """Each step of ``src`` (format ``fmt``, which lists its steps: :attr:`ImportFormat.steps`) read alone, in
    order. ``workers`` > 1 (default :func:`default_workers`): read on that many worker processes, at most
    ``workers + 1`` steps ahead of the one handed out, so memory holds a few steps whatever the source's size."""
    importer = IMPORTERS[fmt]
    assert importer.steps is not None
    options = dict(options or {})
    steps = importer.steps(src, **options)
    workers = default_workers() if workers is None else workers
    if workers <= 1 or len(steps) <= 1:
        for step in steps:
            yield _read_step(fmt, src, version, step, options)
        return
    # fork is cheap and safe while this process has no other thread (the usual case: the loggers start once the
    # first step is back, after every worker exists); with threads running, workers start from a clean server
    method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(min(workers, len(steps)), mp_context=mp.get_context(method)) as pool:
        ahead: collections.deque = collections.deque()
        todo = iter(steps)
        try:
            for step in itertools.islice(todo, workers + 1):
                ahead.append(pool.submit(_read_step, fmt, src, version, step, options))
            while ahead:
                part = ahead.popleft().result()
                for step in itertools.islice(todo, 1):
                    ahead.append(pool.submit(_read_step, fmt, src, version, step, options))
                yield part
        finally:
            for future in ahead:
                future.cancel()


ANY_EXPERT = int(np.iinfo(np.int16).max)
"""The expert count a run is declared with when neither the source nor the tokenizer's directory names it (the
dumps keep expert ids, not the count): ids are then checked against the int16 column's range only."""


def routing_shape(run: ImportedRun, vocab: Any = None) -> tuple[int, int, int] | None:
    """The ``routing_shape`` ``(MoE layers, top-k, experts)`` of a source that holds routed experts (None when it
    holds none): layers and top-k from its arrays; the expert count from the model config beside the tokenizer
    (``--tokenizer``, a model directory), else :data:`ANY_EXPERT`. ImportFormatError when that config's layers or
    top-k differ from the arrays', naming both shapes."""
    if run.routing is None:
        return None
    from trustscope.routing import moe_shape

    layers, top_k = run.routing
    where = getattr(vocab, "name_or_path", None)
    try:
        model = json.loads((Path(where) / "config.json").read_text(), object_hook=_attrs) if where else None
    except (OSError, ValueError):  # no model config beside the tokenizer
        model = None
    if not isinstance(model, _attrs) or model.num_hidden_layers is None:
        return layers, top_k, ANY_EXPERT
    config = moe_shape(model)
    if config is None:
        raise ImportFormatError(f"{run.src}: routed experts of shape (tokens, {layers}, {top_k}), but the model "
                                f"config in {where} is a dense model (it names no experts)")
    if config[:2] != (layers, top_k):
        raise ImportFormatError(f"{run.src}: routed experts of shape (tokens, {layers}, {top_k}), but the model "
                                f"config in {where} routes (tokens, {config[0]}, {config[1]}) (MoE layers, top-k)")
    return config


class _attrs(dict):
    """A JSON object read as attributes (``config.num_experts``), missing ones None, for :func:`moe_shape`."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


def check_experts(seq: Sequence, shape: tuple[int, int, int]) -> None:
    """Routed experts on scored positions against the run's ``routing_shape``: an id outside ``[0, experts)``
    (-1, the writers' filler, excepted) is refused naming the sequence, the position and the value."""
    arr = seq.engine_experts
    if arr is None:
        return
    bad = seq.mask[:, None, None] & ((arr < -1) | (arr >= shape[2]))
    if bad.any():
        pos, layer, slot = (int(x) for x in np.argwhere(bad)[0])
        raise ImportFormatError(f"{seq.where}: engine_experts {int(arr[pos, layer, slot])} at response position "
                                f"{pos}, MoE layer {layer}, slot {slot}: expert ids are in [0, {shape[2]})")


def check_routing(run: ImportedRun, shape: tuple[int, int, int], where: Any) -> None:
    """A part's routed experts against the run's ``routing_shape``: the same (MoE layers, top-k) as the steps
    before (ImportFormatError naming ``where`` and both shapes: a run does not mix models), and every id in range
    (:func:`check_experts`)."""
    if run.routing not in (None, shape[:2]):
        raise ImportFormatError(f"{where}: routed experts of (MoE layers, top-k) {run.routing}, the run's "
                                f"{shape[:2]}: a run does not mix models")
    for seq in run.sequences:
        check_experts(seq, shape)


def write_run(run: ImportedRun, logdir: str | Path, run_id: str | None = None, vocab: Any = None,
              token_fraction: float = 1.0) -> Path:
    """Write ``run`` (a whole source, read) as ``<logdir>/<run_id>``: :func:`write_steps` of it alone."""
    return write_steps(iter([run]), logdir, run_id, vocab=vocab, token_fraction=token_fraction)


def write_steps(parts: Iterator[ImportedRun], logdir: str | Path, run_id: str | None = None, vocab: Any = None,
                token_fraction: float = 1.0, combine: Callable[[ImportedRun, ImportedRun], ImportedRun] = combine
                ) -> Path:
    """Write the parts of one source (its steps, each read alone, in order; or the whole source as one part) as
    ``<logdir>/<run_id>`` through :class:`TokenLogger`; returns the run directory.

    ``vocab`` (a tokenizer or a list of token texts, as ``TokenLogger`` takes it) writes the run's vocab table, so
    statistics name tokens. Each source rank is written by its own logger (rank 0 always exists: it writes
    ``run.json``); each part's values are checked before any of its rows is logged. The run is built in
    ``<logdir>/.import-<run_id>-<random>/`` and renamed into place when every logger has closed; on any error
    (a part that does not parse, a value no writer produces) the temporary directory is removed and the error
    re-raised, so nothing is written. ``run.json`` then records what the whole source held
    (``combine`` over the parts: format, notes, files, sequences, unscored tokens). The fields trustscope does not
    know are kept as the run's own columns (``extra_columns``, the types the first part shows) or left out, and
    named once (:func:`name_unknown`).

    ``token_fraction`` < 1 writes the token rows of that share of sequences (the logger's hash of step and sample
    id) and the exact ``summaries`` table over every token, as a trainer's logger does.
    """
    from trustscope.logger import TokenLogger  # the parse above needs none of the writer's libraries
    from trustscope.runformat.fsops import fsync_file

    vocab_size = None if vocab is None else len(vocab)
    first = next(parts, None)
    if first is None:
        raise ImportFormatError("the source holds no step")
    for seq in first.sequences:
        check_values(seq, vocab_size)
    logdir = Path(logdir)
    run_id = run_id or f"{first.framework}-{first.src.resolve().name}"
    target = logdir / run_id
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose another --run-id or remove it")
    logdir.mkdir(parents=True, exist_ok=True)
    tmp_root = logdir / f".import-{run_id}-{secrets.token_hex(4)}"
    header = dataclasses.replace(first, sequences=[], scalars={})  # the run's description, without its rows
    declared = dict(first.extra_types)
    routed = routing_shape(first, vocab)  # the first part's routed experts declare the run's routing_shape
    loggers: dict[int, TokenLogger] = {}
    sequences = unscored_tokens = 0
    nulled: list[str] = []

    def described(run: ImportedRun) -> tuple[dict, dict]:
        config = {"import": {"format": run.format, "src": str(run.src), "files": run.files,
                             "sequences": sequences, "unscored_tokens": unscored_tokens, "columns": run.notes}}
        return config, {"framework": run.framework, "version": run.version, "format": run.format,
                        "src": str(run.src)}

    def logger(rank: int) -> TokenLogger:
        if rank not in loggers:
            config, source = described(header)
            # with every token written the token rows are exact without the summaries table, whose rule masks
            # need torch; a token_fraction sample gets the exact summaries over every token, as the logger has
            loggers[rank] = TokenLogger(tmp_root, run_id, config=config, loss_rule=header.loss_rule, vocab=vocab,
                                        mu_source="imported", source=source, rank=rank, flush_seconds=3600.0,
                                        summaries=token_fraction < 1.0, token_fraction=token_fraction,
                                        extra_columns=declared, routing_shape=routed,
                                        fsync=False)  # synced once, before the rename
        return loggers[rank]

    try:
        logger(0)  # rank 0 first: it writes run.json
        part: ImportedRun | None = first
        del first  # each part's rows go once they are logged
        checked = True  # the first part's values are, above
        while part is not None:
            if not checked:
                for seq in part.sequences:
                    check_values(seq, vocab_size)
                header = combine(header, part)
            checked = False
            if routed is not None:
                check_routing(part, routed, part.src)
            by_step: dict[int, list[Sequence]] = {}
            for seq in part.sequences:
                by_step.setdefault(seq.step, []).append(seq)
            for rank in sorted({s.rank for s in part.sequences}):
                logger(rank)
            for step in sorted(set(by_step) | set(part.scalars)):
                left = log_step(loggers, step, by_step.get(step, []), part.scalars.get(step),
                                extra_types=declared, loss_rule=part.loss_rule, routing=routed is not None)
                nulled += [name for name in left if name not in nulled]
            sequences += len(part.sequences)
            unscored_tokens += unscored(part.sequences)
            part = next(parts, None)
        for rank in sorted(loggers, reverse=True):  # rank 0 last
            loggers.pop(rank).close()
        config, source = described(header)
        if nulled:
            config["import"]["columns"]["nulls"] = (f"left out (NULL) of the steps where a scored token held a null: "
                                                    f"{', '.join(nulled)}")
        _describe(tmp_root / run_id, config, source, header.loss_rule)
        sync_tree(tmp_root / run_id)
        (tmp_root / run_id).rename(target)
        fsync_file(logdir)  # the rename
    except BaseException:
        for open_logger in loggers.values():
            with contextlib.suppress(Exception):  # the import's own error is the one to report
                open_logger.close(status="crashed", error="import failed")
        raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
        with contextlib.suppress(Exception):  # the workers' steps still in flight are dropped
            parts.close()  # type: ignore[attr-defined]
    name_unknown(header, declared)
    return target


def sync_tree(root: Path) -> None:
    """Put every file under ``root`` and every directory's entries on disk. An import's loggers write without
    syncing each file (nothing is visible until the finished run is renamed into place, so a killed import leaves
    no partial run whatever was synced); the run is synced once, before that rename, so the renamed run is as
    durable as one whose every file was synced as it was written."""
    from trustscope.runformat.fsops import fsync_file

    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_file(Path(folder, name))
        fsync_file(folder)


def _describe(run_dir: Path, config: dict, source: dict, loss_rule: str) -> None:
    """Put what the whole source held into ``run.json`` of a finished import (the loggers opened with what the
    first step showed); the run is not in place yet, so no reader sees the first version."""
    from trustscope.runformat.layout import MANIFEST

    path = run_dir / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(config=config, source=source, loss_rule=loss_rule)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, path)
