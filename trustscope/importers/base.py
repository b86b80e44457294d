"""Shared base of the importers: the registry (:func:`register_importer`, the :class:`Importer` protocol), and
parsed sequences -> one trustscope run, written all or nothing.

Every importer reads its framework's files completely into :class:`ImportedRun` (one :class:`Sequence` per
response, scalars per step) and raises :class:`ImportFormatError` naming the file and line (or tensor key) at the
first thing that does not match the writer's format. Only then does :func:`write_run` write, through
:class:`~trustscope.logger.TokenLogger`'s public API, into a hidden temporary directory inside the log directory,
and rename the finished run directory into place. A failure at any point removes the temporary directory, so the
target log directory never holds a partial import.

Unscored tokens (a NaN or null log-prob, entropy or advantage on a trained position: the frameworks write those
where the engine or trainer returned nothing finite) are left out of the token table and counted in ``run.json``
(``config.import.unscored_tokens``), the same way a trainer's own mask leaves tokens out.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import orjson

from trustscope.columns import turns_from_mask
from trustscope.schema import LOGPROB_TOLERANCE

__all__ = ["IMPORTERS", "ImportFormat", "ImportFormatError", "ImportUsageError", "ImportedRun", "Importer",
           "SameThroughout", "Sequence", "json_lines", "log_step", "register_importer", "unscored", "write_run"]


class ImportFormatError(ValueError):
    """A source file that does not match its writer's format. The message starts with the file (and line or key)."""


class ImportUsageError(ValueError):
    """A format no importer is registered for, or an option the format does not take."""


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


IMPORTERS: dict[str, ImportFormat] = {}
"""Every registered format by name, in the order registered; :mod:`trustscope.importers` registers the built-in
ones."""


def register_importer(name: str, *, reads: str, options: Mapping[str, str] | None = None
                      ) -> Callable[[Importer], Importer]:
    """Register the decorated function as the importer of format ``name``.

    ``reads``: what the format's files are, in one line (``trustscope import --help`` lists it). ``options``: the
    keyword flags the importer takes beyond ``version``, each with what it does (the CLI's ``--allow-pickle`` is
    ``allow_pickle``); an option given for a format that does not declare it is refused.
    """

    def add(read: Importer) -> Importer:
        if name in IMPORTERS:
            raise ValueError(f"import format {name!r} is registered twice")
        IMPORTERS[name] = ImportFormat(name, read, reads, dict(options or {}))
        return read

    return add


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


def json_lines(path: Path, partial_tail: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)`` for each line of a JSONL file; a truncated or unparsable line is an error.

    ``partial_tail``: a file another process is still appending to; its last line without a newline is not
    written yet and is left out instead of refused.

    Parsed by orjson (about 9x faster than ``json`` on token-export lines); a line orjson refuses is parsed again
    by Python's ``json``, which also accepts the bare ``NaN`` / ``Infinity`` that ``json.dumps`` writes by default.
    """
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                if partial_tail:
                    return
                raise ImportFormatError(f"{path}:{number}: last line has no newline: the file is truncated "
                                        f"(the writer ends every record with one)")
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = _loads_python(raw, f"{path}:{number}")
            yield number, obj


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


def _padded(seqs: list[Sequence], name: str, width: int, fill: Any, dtype: Any) -> np.ndarray:
    out = np.full((len(seqs), width), fill, dtype=dtype)  # (B, T)
    for i, seq in enumerate(seqs):
        arr = getattr(seq, name)
        out[i, : len(arr)] = arr
    return out


def _step_call(seqs: list[Sequence], sample_ids: list[int], prompt_ids: list[int]) -> tuple[dict, np.ndarray, dict]:
    """The padded ``tokens``, ``mask`` and ``samples`` arguments of one ``log_step`` call."""
    width = max((len(s.token_id) for s in seqs), default=0)
    mask = np.zeros((len(seqs), width), dtype=bool)  # (B, T)
    for i, seq in enumerate(seqs):
        mask[i, : len(seq.mask)] = _scored(seq)
    tokens: dict[str, Any] = {
        "token_id": _padded(seqs, "token_id", width, 0, np.int64),
        "mu_logprob": _padded(seqs, "mu_logprob", width, 0.0, np.float32),
        "pi_logprob": _padded(seqs, "pi_logprob", width, 0.0, np.float32),
        "advantage": _padded(seqs, "advantage", width, 0.0, np.float32),
        "sample_id": np.array(sample_ids, dtype=np.int64),
        "prompt_id": np.array(prompt_ids, dtype=np.int64),
    }
    for name in ("old_logprob", "entropy"):
        if all(getattr(s, name) is not None for s in seqs):
            tokens[name] = _padded(seqs, name, width, 0.0, np.float32)
    turns = np.zeros((len(seqs), width), dtype=np.int32)  # (B, T) the model turn: a new one after each gap
    for i, seq in enumerate(seqs):  # in the trained positions (a multi-turn trajectory's environment tokens)
        turns[i, : len(seq.mask)] = turns_from_mask(seq.mask)
    tokens["turn"] = turns
    if any(s.kept is not None for s in seqs):
        kept = np.ones((len(seqs), width), dtype=bool)
        for i, seq in enumerate(seqs):
            if seq.kept is not None:
                kept[i, : len(seq.kept)] = seq.kept
        tokens["kept"] = kept
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
    return tokens, mask, samples


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
             ranks: Collection[int] | None = None) -> None:
    """Log one step's sequences (each source rank through its own logger of ``loggers``) and scalars (rank 0's
    logger), one ``log_step`` call per rank, so no flush ever holds part of a rank's share of the step.
    ``ranks``: only these ranks' share (a followed run, whose ranks commit one after the other); None, all."""
    seqs = sorted(seqs, key=lambda s: s.rank)
    sample_ids, prompt_ids = _ids(seqs)  # over the whole step, whichever ranks are logged
    present = {s.rank for s in seqs}
    for rank in sorted(present | ({0} if scalars else set())):
        if ranks is not None and rank not in ranks:
            continue
        kwargs: dict[str, Any] = {"scalars": scalars} if rank == 0 and scalars else {}
        if rank in present:
            idx = [i for i, s in enumerate(seqs) if s.rank == rank]
            kwargs["tokens"], kwargs["mask"], kwargs["samples"] = _step_call(
                [seqs[i] for i in idx], [sample_ids[i] for i in idx], [prompt_ids[i] for i in idx])
        loggers[rank].log_step(step, **kwargs)


def unscored(seqs: list[Sequence]) -> int:
    """Trained tokens left out as unscored (a NaN log-prob, advantage or entropy)."""
    return int(sum(int((s.mask & ~_scored(s)).sum()) for s in seqs))


def write_run(run: ImportedRun, logdir: str | Path, run_id: str | None = None, vocab: Any = None,
              token_fraction: float = 1.0) -> Path:
    """Write ``run`` as ``<logdir>/<run_id>`` through :class:`TokenLogger`; returns the run directory.

    ``vocab`` (a tokenizer or a list of token texts, as ``TokenLogger`` takes it) writes the run's vocab table, so
    statistics name tokens. Each source rank is written by its own logger (rank 0 always exists: it writes
    ``run.json``). The run is built in ``<logdir>/.import-<run_id>-<random>/`` and renamed into place when every
    logger has closed; on any error the temporary directory is removed and the error re-raised.

    ``token_fraction`` < 1 writes the token rows of that share of sequences (the logger's hash of step and sample
    id) and the exact ``summaries`` table over every token, as a trainer's logger does.
    """
    from trustscope.logger import TokenLogger  # the parse above needs none of the writer's libraries

    vocab_size = None if vocab is None else len(vocab)
    for seq in run.sequences:
        check_values(seq, vocab_size)
    logdir = Path(logdir)
    run_id = run_id or f"{run.framework}-{run.src.resolve().name}"
    target = logdir / run_id
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose another --run-id or remove it")
    logdir.mkdir(parents=True, exist_ok=True)
    tmp_root = logdir / f".import-{run_id}-{secrets.token_hex(4)}"
    config = {"import": {"format": run.format, "src": str(run.src), "files": run.files,
                        "sequences": len(run.sequences), "unscored_tokens": unscored(run.sequences),
                        "columns": run.notes}}
    source = {"framework": run.framework, "version": run.version, "format": run.format, "src": str(run.src)}
    by_step: dict[int, list[Sequence]] = {}
    for seq in run.sequences:
        by_step.setdefault(seq.step, []).append(seq)
    ranks = sorted({0, *(s.rank for s in run.sequences)})
    loggers: dict[int, TokenLogger] = {}
    try:
        for rank in ranks:  # rank 0 first: it writes run.json
            # with every token written the token rows are exact without the summaries table, whose rule masks
            # need torch; a token_fraction sample gets the exact summaries over every token, as the logger has
            loggers[rank] = TokenLogger(tmp_root, run_id, config=config, loss_rule=run.loss_rule, vocab=vocab,
                                        mu_source="imported", source=source, rank=rank, flush_seconds=3600.0,
                                        summaries=token_fraction < 1.0, token_fraction=token_fraction)
        for step in sorted(set(by_step) | set(run.scalars)):
            log_step(loggers, step, by_step.get(step, []), run.scalars.get(step))
        for rank in reversed(ranks):
            loggers.pop(rank).close()
        (tmp_root / run_id).rename(target)
    except BaseException:
        for logger in loggers.values():
            with contextlib.suppress(Exception):  # the import's own error is the one to report
                logger.close(status="crashed", error="import failed")
        raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return target
