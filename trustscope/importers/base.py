"""Shared base of the importers: the registry (:func:`register_importer`, the :class:`Importer` protocol), the parsed
form of a source (:class:`ImportedRun` of :class:`Sequence`), the readers of its records, and the checks every
sequence passes; :mod:`trustscope.importers.writer` writes it into one trustscope run, all or nothing.

Every importer reads its framework's files (all, or the steps asked for) into :class:`ImportedRun` (one
:class:`Sequence` per response, scalars per step) and raises :class:`ImportFormatError` naming the file and line
(or tensor key) at the first thing that does not match the writer's format.

Fields a writer's known layout does not have are kept on each sequence (:func:`keep_unknown`) and become the
run's own columns (``extra_columns``) where a column takes them; :func:`name_unknown` names them once.

Unscored tokens (a NaN or null log-prob, entropy or advantage on a trained position: the frameworks write those
where the engine or trainer returned nothing finite) are left out of the token table and counted in ``run.json``
(``config.import.unscored_tokens``), the same way a trainer's own mask leaves tokens out.

Routed experts (a mixture-of-experts run whose source keeps the engine's, :attr:`Sequence.engine_experts`) become
the ``engine_experts`` column; the sources hold the engine's side only, so no ``trainer_experts`` and no
agreement.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import orjson

from trustscope.runformat.layout import LOGPROB_TOLERANCE

__all__ = ["IMPORTERS", "ImportFormat", "ImportFormatError", "ImportUsageError", "ImportedRun", "Importer",
           "Listing", "SameThroughout", "Sequence", "SourceGone", "checked_options", "combine", "format_for",
           "json_lines", "keep_unknown", "name_unknown", "register_importer"]


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
    """Everything one source holds, parsed and checked, ready for
    :func:`~trustscope.importers.writer.write_run`."""

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


def scored(seq: Sequence) -> np.ndarray:
    """``mask`` minus the unscored positions (NaN in any float column)."""
    ok = seq.mask.copy()
    for arr in (seq.mu_logprob, seq.pi_logprob, seq.advantage, seq.old_logprob, seq.entropy):
        if arr is not None:
            ok &= np.isfinite(arr)
    return ok


NUMPY_TYPES = {"bool": np.bool_, "int64": np.int64, "float64": np.float64, "string": object}


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


