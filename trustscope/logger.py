"""Per-token logging of an RL run to append-only Parquet: :class:`TokenLogger` and the no-op :class:`NullLogger`.

Usage in a GRPO-style trainer::

    from trustscope.logger import TokenLogger

    with TokenLogger("logs", run_id="dppo-0", config=asdict(cfg), model={"name": "Qwen2-tiny"},
                     sampling=engine.sampling_info(), tokenizer={"name": "char"}, vocab=vocab_texts,
                     loss_rule="dppo_binary_tv") as logger:
        for step in range(cfg.steps):
            ...
            logger.log_step(
                step,
                tokens={                                  # padded batch: arrays (B, T) / (B, T, K) + mask
                    "token_id": response_ids,             # (B, T) int
                    "mu_logprob": mu_logprob,             # (B, T)
                    "pi_logprob": pi_logprob,             # (B, T)  (detached; grads are ignored)
                    "old_logprob": old_logprob,           # (B, T)  optional
                    "advantage": advantages,              # (B, T) or (B,)
                    "entropy": entropy,                   # (B, T)  optional
                    "mu_topk_ids": mu_topk_ids,           # (B, T, K) optional
                    "mu_topk_logprobs": mu_topk_logprobs, # (B, T, K) optional
                    "pi_topk_logprobs": pi_topk_logprobs, # (B, T, K) optional
                    "kept": loss_out.keep,                # (B, T) bool, optional (default True)
                },
                mask=mask,                                # (B, T) bool: real response tokens
                samples={
                    "sample_id": sample_ids,              # (B,) int, unique within the step over all ranks
                    "prompt_id": prompt_ids,              # (B,) int
                    "prompt": prompts, "response": texts, # list[str] (optional)
                    "reward": rewards,                    # (B,) (optional)
                    "advantage": seq_advantages,          # (B,) (optional)
                    "finish_reason": finish_reasons,      # list[str] (optional)
                    # "length" is optional: mask.sum(1) is used, and a given one must agree with it
                },
                scalars={"loss": loss.item(), "reward/mean": r.mean(), "lr": lr},
            )

Arguments of :meth:`TokenLogger.log_step`:

- ``step`` (int): the training step. Steps never go backwards; the same step may be logged in several calls
  (micro-batches) as long as sample ids do not repeat. After ``resume=True`` a step must be above every step
  already on disk for this rank.
- ``tokens`` (dict): columns of the ``tokens`` table (:data:`trustscope.schema.TOKENS`) as torch tensors, numpy
  arrays or lists. Padded form: ``(B, T)`` per-token columns, ``(B, T, K)`` top-K columns, ``(B,)`` per-sequence
  columns (``sample_id``, ``prompt_id``, ``advantage`` broadcast over T), with ``mask`` ``(B, T)``. Ragged form
  (``mask=None``): each per-token column is a list of B 1-D sequences of length ``T_i`` (top-K: ``(T_i, K)``).
  Required: ``token_id``, ``mu_logprob``, ``pi_logprob``, ``advantage`` (here or ``samples['advantage']``) and
  ``prompt_id`` (here or in ``samples``). ``sample_id`` may come from ``tokens`` or ``samples`` and defaults to
  ``arange(B)``; it must be unique within the step over all ranks (e.g. ``rank * B + i``). ``kept`` defaults to
  True. ``run_id``, ``step``, ``rank``, ``pos``, ``loss_rule`` are filled in by the logger. ``topk_tv`` /
  ``topk_kl`` are computed (:mod:`trustscope.divergence`, in the writer thread) when both top-K logprob lists are
  given and they are not. mu's top-K must already hold the sampled token
  (:func:`trustscope.divergence.force_sampled_into_topk`). Logprobs up to 1e-5 above 0 are stored as 0.
- ``mask``: ``(B, T)`` bool, True on real response tokens (padded form only). ``pos`` is the column index.
- ``samples`` (dict): columns of the ``samples`` table, each of length B (row i describes tokens row i). May be
  given without ``tokens`` (then ``length`` is required); ``length`` defaults to the mask's row sums.
- ``scalars`` (dict[str, float]): written to the ``steps`` table (NaN and inf are kept). May be the only argument.
- ``loss_rule`` (str): overrides the logger's ``loss_rule`` for this call.

Bad input (NaN/inf or positive logprobs, top-K lists of the wrong length, lengths that disagree with the mask,
unknown columns, a step that goes backwards) raises :class:`trustscope.schema.SchemaError` naming the field and
the value; with ``strict=False`` it warns (:class:`LogWarning`) and drops the bad token rows (or the whole call when
the problem is not in a row). Nothing already written is touched.

``log_step`` copies the data (tensors go to CPU numpy), checks it and puts it on a bounded queue; a background
thread turns it into Arrow and writes one file per table when ``flush_rows`` token rows are buffered, every
``flush_seconds``, on :meth:`flush` and on :meth:`close`. When the queue is full ``log_step`` waits (back-pressure).
Errors of the writer thread (disk full, ...) are raised by the next ``log_step``/``flush``/``close`` (strict) or
warned about (``strict=False``).

Constructor ``TokenLogger(logdir, run_id=None, *, config=None, model=None, sampling=None, tokenizer=None,
vocab=None, loss_rule="none", mu_source="engine", source=None, rank=None, resume=False, strict=True, token_fraction=1.0, log_topk=True,
topk_precision="float32", flush_rows=1_000_000, flush_seconds=30.0, max_queue=8, seed=0, row_group_size=131072,
fsync=True)``:

- ``run_id``: default ``<UTC time>-<random>``; ``rank``: default from ``torch.distributed`` (when initialised)
  or the ``RANK`` environment variable, else 0. Each rank writes its own files; rank 0 writes ``run.json`` and
  the vocab, other ranks ``ranks/rank<r>.json``.
- ``loss_rule``: the rule the trainer applied (a name from :func:`trustscope.losses.list_losses` or the
  framework's own, e.g. ``"trl:grpo"``); recorded in ``run.json`` and on every token row.
- ``mu_source``: where ``mu_logprob`` comes from: ``"engine"`` (the inference engine's log-probs),
  ``"trainer_recompute"`` (the framework kept none, so mu is the trainer's own recompute and mismatch reads ~0),
  or ``"imported"`` (read from another framework's dump). Recorded in ``run.json``.
- ``source``: which framework wrote the run, e.g. ``{"framework": "trl", "version": "1.16.0"}``; default
  trustscope itself. Recorded in ``run.json``.
- ``vocab``: token texts indexed by id (``list[str]``), or a ``dict[int, str]``, or a Hugging Face tokenizer.
- ``resume``: continue an existing run (new files only, nothing overwritten). Without it an existing run id is an
  error.
- ``token_fraction``: log the tokens of only this fraction of sequences (chosen by a hash of seed, step and
  sample_id, so every rank agrees); samples and scalars are always logged in full.
- ``log_topk=False``: leave the top-K list columns out (null); ``topk_tv`` / ``topk_kl`` are still computed.
- ``topk_precision="float16"``: round top-K logprobs to float16's 10-bit mantissa (still stored as float32, so the
  schema does not change), which makes them compress much better; ``topk_tv``/``topk_kl`` are computed before the
  rounding. The precision it costs is in ``docs/performance.md``.

Files are ``<table>/r<rank>-s<first step>-<last step>-<session>-<seq>.parquet``, row groups of ``row_group_size``
rows (DuckDB's own row-group size is about the same), fsync'ed before the rename unless ``fsync=False``.
What was sampled is written into the manifest (``logging`` key), with ``last_step`` and ``rows`` flushed so far. :meth:`TokenLogger.close` (or leaving the
``with`` block) flushes and marks the run ``finished``; leaving it by an exception marks it ``crashed``; a process
that dies leaves ``running`` with a dead writer pid, which :func:`run_status` reads as ``crashed``.

This module imports torch only when it is handed tensors or must compute top-K divergences.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import secrets
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import __version__
from trustscope import schema as S
from trustscope.schema import SchemaError

__all__ = ["LogDirError", "LogWarning", "NullLogger", "SchemaError", "TokenLogger", "rank_statuses", "run_status"]


class LogWarning(UserWarning):
    """Rows or calls dropped by a ``strict=False`` logger, or a write that failed in the background."""


class LogDirError(OSError):
    """The log directory cannot be created or written, or the run exists and ``resume`` was not asked for."""


# Columns the caller may pass; the rest are filled in by the logger.
# Where mu_logprob came from: the inference engine's own log-probs (the real behaviour policy), or, for
# frameworks that keep none, the trainer's recompute (then mu == pi_old and no mismatch can be measured).
MU_SOURCES = frozenset({"engine", "trainer_recompute", "imported"})

TOKEN_INPUTS = tuple(n for n in S.TOKENS.names if n not in ("run_id", "step", "rank", "pos", "loss_rule"))
SAMPLE_INPUTS = tuple(n for n in S.SAMPLES.names if n not in ("run_id", "step", "rank"))
PER_SEQUENCE = ("sample_id", "prompt_id")  # always (B,)
MAYBE_PER_SEQUENCE = ("advantage",)  # (B,) broadcast over T, or (B, T)
FLOAT_TOKEN_COLUMNS = ("mu_logprob", "old_logprob", "pi_logprob", "advantage", "entropy", "topk_tv", "topk_kl")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks (Linux), to tell a live writer from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return _process_start(pid) == start
    return True


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = S.tmp_path(path)
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def resolve_rank(rank: int | None = None) -> int:
    """The process's rank: ``rank`` if given, else torch.distributed's (when initialised), else ``$RANK``, else 0."""
    if rank is not None:
        return int(rank)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


# ----------------------------------------------------------------------------------------------- input conversion


def _is_tensor(x: Any) -> bool:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # torch may be importing in the writer thread
    return tensor is not None and isinstance(x, tensor)


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view or copy of a tensor, array, scalar or (nested, rectangular) list."""
    if _is_tensor(x):
        x = x.detach()
        if x.is_floating_point() and x.dtype.itemsize < 4:
            x = x.float()
        return x.cpu().numpy()
    try:
        arr = np.asarray(x)
    except ValueError as err:
        raise SchemaError(f"{name}: cannot be read as an array ({err})") from None
    if arr.dtype == object:
        raise SchemaError(f"{name}: ragged or non-numeric values cannot form an array; pass mask=None with one "
                          f"sequence per sample for ragged input")
    return arr


def _is_ragged(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and not np.isscalar(x[0]) and x[0] is not None


def _as_float(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.dtype.kind not in "fiub":
        raise SchemaError(f"{name}: expected numbers, got dtype {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def _as_int(arr: np.ndarray, name: str, dtype: type = np.int64) -> np.ndarray:
    if arr.dtype.kind == "f":
        if arr.size and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
            bad = arr[~(np.isfinite(arr) & (arr == np.round(arr)))][0]
            raise SchemaError(f"{name}: expected integers, got {bad}")
    elif arr.dtype.kind not in "iub":
        raise SchemaError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def _keep_hash(seed: int, step: int, sample_id: np.ndarray) -> np.ndarray:
    """A uniform value in [0, 1) per sample, from (seed, step, sample_id) alone (splitmix64), so ranks agree."""
    with np.errstate(over="ignore"):
        z = sample_id.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def _within(arr: np.ndarray, low: float, high: float, finite: bool = False) -> bool:
    """Fast check by two reductions (no temporaries): every value in [low, high] (and finite) and none NaN."""
    if arr.size == 0:
        return True
    lo, hi = arr.min(), arr.max()  # NaN propagates into both
    if finite and (np.isinf(lo) or np.isinf(hi)):
        return False
    return bool(lo >= low) and bool(hi <= high)


@dataclass
class _Batch:
    """One call's data, checked and flattened to token rows; owned by the writer thread once queued."""

    step: int
    loss_rule: str
    tokens: dict[str, np.ndarray] | None  # flat columns, N rows (top-K: (N, K))
    samples: dict[str, Any] | None
    scalars: list[tuple[str, float]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return 0 if self.tokens is None else len(self.tokens["token_id"])


class _Rejected(Exception):
    """Internal: a problem that drops the whole call (strict=False) or raises SchemaError (strict)."""


class _Checker:
    """Collects row problems (strict: raise at once; not strict: drop rows with a warning)."""

    def __init__(self, strict: bool, n: int, where: Any):
        self.strict = strict
        self.bad = np.zeros(n, dtype=bool)
        self.where = where  # callable(row index) -> str
        self.messages: list[str] = []

    def rows(self, ok: np.ndarray, name: str, what: str, values: np.ndarray) -> None:
        """Flag the rows where element-wise ``ok`` (shape of ``values``: ``(N,)`` or ``(N, K)``) is False."""
        ok_rows = ok if ok.ndim == 1 else ok.all(axis=1)
        if ok_rows.all():
            return
        idx = np.flatnonzero(~ok_rows)
        first = values[idx[0]] if ok.ndim == 1 else values[idx[0]][~ok[idx[0]]][0]
        msg = f"{name} {what}, got {first.item()} at {self.where(idx[0])} ({len(idx)} bad row(s))"
        if self.strict:
            raise SchemaError(msg)
        self.bad[idx] = True
        self.messages.append(msg)


def _flatten_tokens(
    tokens: Mapping[str, Any], mask: Any
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Token columns as flat rows. Returns (columns, row -> sequence index b, row -> pos, lengths (B,)).

    Per-token columns become ``(N,)``, top-K columns ``(N, K)``, per-sequence columns are broadcast.
    """
    if "token_id" not in tokens:
        raise _Rejected("tokens['token_id'] is required")
    if mask is None and isinstance(tokens["token_id"], (list, tuple)):
        return _flatten_ragged(tokens)
    token_id = _to_numpy(tokens["token_id"], "tokens['token_id']")
    if token_id.ndim != 2:
        raise _Rejected(f"tokens['token_id'] must be (B, T) with a mask, or ragged with mask=None; "
                        f"got shape {token_id.shape}")
    B, T = token_id.shape
    if mask is None:
        m = np.ones((B, T), dtype=bool)
    else:
        m = _to_numpy(mask, "mask")
        if m.shape != (B, T):
            raise _Rejected(f"mask has shape {m.shape}, tokens['token_id'] has {(B, T)}: they must agree")
        if m.dtype != np.bool_:
            if not np.isin(m, (0, 1)).all():
                raise _Rejected(f"mask must be boolean (or 0/1), got value {m[~np.isin(m, (0, 1))][0]}")
            m = m.astype(bool)
    full = bool(m.all())
    if full:
        b = np.repeat(np.arange(B), T)
        t = np.tile(np.arange(T, dtype=np.int32), B)
    else:
        b, t = np.nonzero(m)
        t = t.astype(np.int32)
    cols: dict[str, np.ndarray] = {}
    for name, value in tokens.items():
        arr = _to_numpy(value, f"tokens[{name!r}]")
        label = f"tokens[{name!r}]"
        if name in S.TOPK_COLUMNS:
            if arr.ndim != 3 or arr.shape[:2] != (B, T):
                raise _Rejected(f"{label} must have shape (B, T, K) = ({B}, {T}, K), got {arr.shape}")
            cols[name] = arr.reshape(B * T, -1).copy() if full else arr[b, t]
        elif name in PER_SEQUENCE or (name in MAYBE_PER_SEQUENCE and arr.ndim == 1):
            if arr.shape != (B,):
                raise _Rejected(f"{label} must have shape (B,) = ({B},), got {arr.shape}")
            cols[name] = arr[b]
        else:
            if arr.shape != (B, T):
                raise _Rejected(f"{label} must have shape (B, T) = ({B}, {T}), got {arr.shape}")
            cols[name] = arr.reshape(-1).copy() if full else arr[b, t]
    return cols, b, t, m.sum(axis=1)


def _flatten_ragged(tokens: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    seqs = tokens["token_id"]
    B = len(seqs)
    firsts = [_to_numpy(s, f"tokens['token_id'][{i}]") for i, s in enumerate(seqs)]
    for i, arr in enumerate(firsts):
        if arr.ndim != 1:
            raise _Rejected(f"tokens['token_id'][{i}] must be a 1-D sequence of ids, got shape {arr.shape}")
    lengths = np.array([len(arr) for arr in firsts], dtype=np.int64)
    b = np.repeat(np.arange(B), lengths)
    t = (np.arange(len(b)) - np.repeat(np.cumsum(lengths) - lengths, lengths)).astype(np.int32)
    cols: dict[str, np.ndarray] = {}
    for name, value in tokens.items():
        label = f"tokens[{name!r}]"
        if name in PER_SEQUENCE or (name in MAYBE_PER_SEQUENCE and not _is_ragged(value)):
            arr = _to_numpy(value, label)
            if arr.shape != (B,):
                raise _Rejected(f"{label} must have one value per sample, shape ({B},), got {arr.shape}")
            cols[name] = arr[b]
            continue
        if not isinstance(value, (list, tuple)) or len(value) != B:
            raise _Rejected(f"{label} must be a list of {B} per-sample sequences (like tokens['token_id']), "
                            f"got {type(value).__name__} of length {len(value) if hasattr(value, '__len__') else '?'}")
        parts = [_to_numpy(v, f"{label}[{i}]") for i, v in enumerate(value)]
        for i, part in enumerate(parts):
            ndim_ok = part.ndim == 2 or lengths[i] == 0 if name in S.TOPK_COLUMNS else part.ndim == 1
            if part.ndim == 0 or len(part) != lengths[i] or not ndim_ok:
                want = f"({lengths[i]}, K)" if name in S.TOPK_COLUMNS else f"({lengths[i]},)"
                raise _Rejected(f"{label}[{i}] has shape {part.shape}, but tokens['token_id'][{i}] has length "
                                f"{lengths[i]}: expected {want}")
        if name in S.TOPK_COLUMNS:
            ks = {p.shape[1] for p in parts if p.ndim == 2}
            if len(ks) > 1:
                raise _Rejected(f"{label}: top-K lists of several lengths {sorted(ks)} in one call")
            k = ks.pop() if ks else 0
            parts = [p.reshape(-1, k) for p in parts]
        cols[name] = np.concatenate(parts) if parts else np.zeros(0)
    return cols, b, t, lengths


_FILE_RE = re.compile(r"^r(\d+)-s(\d+)-(\d+)-")
_RUN_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _rank_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its status: ``run.json`` for rank 0, ``ranks/rank<r>.json`` for the others."""
    return run_dir / S.MANIFEST if rank == 0 else run_dir / S.RANKS_DIR / f"rank{rank:04d}.json"


def _rank_data_files(run_dir: Path, rank: int) -> list[Path]:
    prefix = f"r{rank:04d}-"
    return [p for t in S.TABLES if (run_dir / t).is_dir() for p in (run_dir / t).iterdir()
            if p.name.startswith(prefix) and S.is_data_file(p)]


def _last_step_on_disk(run_dir: Path, rank: int) -> int | None:
    steps = [int(m.group(3)) for p in _rank_data_files(run_dir, rank) if (m := _FILE_RE.match(p.name))]
    return max(steps) if steps else None


class _Table:
    """One table's open temporary file and its pending rows (writer thread only)."""

    def __init__(self, name: str, row_group_size: int, prefix: str):
        self.name = name
        self.prefix = prefix
        self.schema = S.with_metadata(name)
        self.options = S.WRITE_OPTIONS[name]
        self.row_group_size = row_group_size
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.rows = 0  # rows in the open file, written or pending
        self.first_step: int | None = None
        self.last_step: int | None = None

    def add(self, table: pa.Table, step: int, directory: Path) -> None:
        if table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if self.pending_rows >= self.row_group_size:
            self._write_pending(directory, whole_groups=True)

    def _write_pending(self, directory: Path, whole_groups: bool) -> None:
        data = pa.concat_tables(self.pending)
        keep = data.num_rows % self.row_group_size if whole_groups else 0
        if self.writer is None:
            self.tmp = S.tmp_path(directory / f"{self.prefix}-open-{secrets.token_hex(6)}.parquet")
            self.writer = pq.ParquetWriter(self.tmp, self.schema, **self.options.writer_kwargs())
        self.writer.write_table(data.slice(0, data.num_rows - keep), row_group_size=self.row_group_size)
        self.pending = [data.slice(data.num_rows - keep)] if keep else []
        self.pending_rows = keep

    def finish(self, directory: Path, name: str, fsync: bool) -> tuple[Path, int] | None:
        """Write what is pending, close the file and rename it to its final name. Returns (path, rows)."""
        if self.rows == 0:
            return None
        if self.pending_rows:
            self._write_pending(directory, whole_groups=False)
        assert self.writer is not None and self.tmp is not None
        self.writer.close()
        if fsync:
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        final = directory / name.format(first=self.first_step, last=self.last_step)
        os.replace(self.tmp, final)
        rows = self.rows
        self.reset()
        return final, rows

    def abort(self) -> None:
        """Drop the open file and pending rows (after a write error)."""
        if self.writer is not None:
            with contextlib.suppress(Exception):  # the file is being thrown away
                self.writer.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        self.reset()

    def reset(self) -> None:
        self.pending, self.pending_rows, self.writer, self.tmp = [], 0, None, None
        self.rows, self.first_step, self.last_step = 0, None, None


def _list_array(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    n, k = values.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)),
                                    type=pa.list_(pa.field("element", value_type, nullable=False)))


class TokenLogger:
    """Logs tokens, samples and scalars of an RL run to ``<logdir>/<run_id>/``. See the module docstring."""

    def __init__(
        self,
        logdir: str | os.PathLike,
        run_id: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        model: Mapping[str, Any] | str | None = None,
        sampling: Mapping[str, Any] | None = None,
        tokenizer: Mapping[str, Any] | str | None = None,
        vocab: Any = None,
        loss_rule: str = "none",
        mu_source: str = "engine",
        source: Mapping[str, Any] | None = None,
        rank: int | None = None,
        resume: bool = False,
        strict: bool = True,
        token_fraction: float = 1.0,
        log_topk: bool = True,
        topk_precision: str = "float32",
        flush_rows: int = 1_000_000,
        flush_seconds: float = 30.0,
        max_queue: int = 8,
        seed: int = 0,
        row_group_size: int = 1 << 17,
        fsync: bool = True,
    ):
        if not 0.0 < token_fraction <= 1.0:
            raise ValueError(f"token_fraction must be in (0, 1], got {token_fraction}")
        if topk_precision not in ("float32", "float16"):
            raise ValueError(f"topk_precision must be 'float32' or 'float16', got {topk_precision!r}")
        for name, value in (("flush_rows", flush_rows), ("max_queue", max_queue), ("row_group_size", row_group_size)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not isinstance(loss_rule, str) or not loss_rule:
            raise ValueError(f"loss_rule must be a non-empty string, got {loss_rule!r}")
        if mu_source not in MU_SOURCES:
            raise ValueError(f"mu_source must be one of {sorted(MU_SOURCES)}, got {mu_source!r}")
        self.run_id = run_id or f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        if not set(self.run_id) <= _RUN_ID_OK or self.run_id.startswith("."):
            raise ValueError(f"run_id {self.run_id!r} may only use letters, digits, '.', '_', '-' "
                             f"and must not start with '.'")
        self.rank = resolve_rank(rank)
        self.logdir = Path(logdir)
        self.run_dir = self.logdir / self.run_id
        self.strict = strict
        self.loss_rule = loss_rule
        self.mu_source = mu_source
        self.source = {"framework": "trustscope", "version": __version__} if source is None else dict(source)
        self.token_fraction = float(token_fraction)
        self.log_topk = log_topk
        self.topk_precision = topk_precision
        self.seed = int(seed)
        self.flush_rows = int(flush_rows)
        self.flush_seconds = float(flush_seconds)
        self.fsync = fsync
        self.vocab_size: int | None = None
        self._k: int | None = None
        self._last_step: int | None = None  # last step accepted by log_step in this process
        self._step_sample_ids: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self._dropped_rows = 0
        self._lock = threading.Lock()
        self._session = secrets.token_hex(3)
        self._seq = 0

        self._disk_last_step = self._open_run(resume)
        self._manifest = self._initial_manifest(resume, config, model, sampling, tokenizer, vocab)
        self._save_manifest()
        if vocab is not None and self.rank == 0:
            self._write_vocab(vocab)
        elif vocab is not None:
            self.vocab_size = len(_vocab_texts(vocab))

        self._tables = {t: _Table(t, int(row_group_size), f"r{self.rank:04d}") for t in S.TABLES}
        self._queue: queue.Queue = queue.Queue(maxsize=int(max_queue))
        self._thread = threading.Thread(target=self._write_loop, name=f"trustscope-logger-r{self.rank}", daemon=True)
        self._thread.start()
        self._atexit = _close_at_exit(self)
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------------------------- opening

    def _open_run(self, resume: bool) -> int | None:
        """Create or reopen the run directory; returns the last step this rank has on disk (resume)."""
        try:
            for sub in (*S.TABLES, S.RANKS_DIR):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".probe-{secrets.token_hex(4)}{S.TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise LogDirError(f"log directory {str(self.logdir)!r} cannot be written: {err}") from None
        status_file = _rank_file(self.run_dir, self.rank)
        exists = status_file.exists() or bool(_rank_data_files(self.run_dir, self.rank))
        if exists and not resume:
            raise LogDirError(f"run {self.run_id!r} already exists in {str(self.logdir)!r} (rank {self.rank}); "
                              f"pass resume=True to continue it, or choose another run_id")
        if not exists:
            return None
        prefix = f"{S.TMP_PREFIX}r{self.rank:04d}-"
        for table in S.TABLES:  # half-written files of a writer that died; no reader ever saw them
            for stale in (self.run_dir / table).glob(f"{prefix}*{S.TMP_SUFFIX}"):
                stale.unlink(missing_ok=True)
        return _last_step_on_disk(self.run_dir, self.rank)

    def _initial_manifest(self, resume: bool, config: Any, model: Any, sampling: Any, tokenizer: Any,
                          vocab: Any) -> dict:
        logging_info = {
            "token_fraction": self.token_fraction,
            "log_topk": self.log_topk,
            "topk_precision": self.topk_precision,
            "topk_k": None,
            "seed": self.seed,
            "strict": self.strict,
            "flush_rows": self.flush_rows,
        }
        if tokenizer is None and vocab is not None and hasattr(vocab, "name_or_path"):
            tokenizer = {"name_or_path": str(vocab.name_or_path), "class": type(vocab).__name__}
        process = {"pid": os.getpid(), "pid_start": _process_start(os.getpid()), "hostname": socket.gethostname()}
        status_file = _rank_file(self.run_dir, self.rank)
        if resume and status_file.exists():
            old = _read_json(status_file)
            if old.get("schema_version", S.SCHEMA_VERSION) != S.SCHEMA_VERSION:
                raise SchemaError(f"{status_file}: schema_version {old.get('schema_version')!r}; this trustscope "
                                  f"writes {S.SCHEMA_VERSION} and cannot append to it")
            self._k = old.get("logging", {}).get("topk_k")
            entry = {"at": _now(), **process, "last_step_on_disk": self._disk_last_step,
                     "previous_status": old.get("status")}
            if config is not None and dict(config) != old.get("config"):
                entry["config"] = dict(config)
            manifest = {**old, **process, "status": "running", "updated_at": _now(), "finished_at": None,
                        "error": None, "logging": {**logging_info, "topk_k": self._k}}
            manifest["resumes"] = [*old.get("resumes", []), entry]
            return manifest
        manifest: dict[str, Any] = {
            "run_id": self.run_id,
            "schema_version": S.SCHEMA_VERSION,
            "trustscope_version": __version__,
            "rank": self.rank,
            "world_size": _world_size(),
            "status": "running",
            **process,
            "created_at": _now(),
            "updated_at": _now(),
            "finished_at": None,
            "error": None,
        }
        if self.rank == 0:
            manifest.update(loss_rule=self.loss_rule, mu_source=self.mu_source, source=_jsonable(self.source))
            manifest.update(config=_jsonable(config), model=_jsonable(model), sampling=_jsonable(sampling),
                            tokenizer=_jsonable(tokenizer))
        manifest.update(logging=logging_info, last_step=self._disk_last_step, rows=dict.fromkeys(S.TABLES, 0),
                        dropped_rows=0, resumes=[])
        return manifest

    def _save_manifest(self, **changes: Any) -> None:
        with self._lock:
            self._manifest.update(changes, updated_at=_now())
            _write_json_atomic(_rank_file(self.run_dir, self.rank), self._manifest)

    def _write_vocab(self, vocab: Any) -> None:
        texts = _vocab_texts(vocab)
        self.vocab_size = len(texts)
        path = self.run_dir / S.VOCAB_FILE
        table = pa.table({"token_id": pa.array(np.arange(len(texts), dtype=np.int32)), "text": pa.array(texts)},
                         schema=S.with_metadata("vocab"))
        tmp = S.tmp_path(path)
        pq.write_table(table, tmp, **S.WRITE_OPTIONS["vocab"].writer_kwargs())
        os.replace(tmp, path)

    # --------------------------------------------------------------------------------------------------- public

    def log_step(
        self,
        step: int,
        tokens: Mapping[str, Any] | None = None,
        mask: Any = None,
        samples: Mapping[str, Any] | None = None,
        scalars: Mapping[str, Any] | None = None,
        loss_rule: str | None = None,
    ) -> None:
        """Check one step's (or micro-batch's) data and queue it for writing. See the module docstring."""
        if self._closed:
            raise RuntimeError(f"TokenLogger of run {self.run_id!r} is closed")
        self._raise_writer_error()
        try:
            batch = self._prepare(step, tokens, mask, samples, scalars, loss_rule)
        except (_Rejected, SchemaError) as err:
            if self.strict:
                raise SchemaError(str(err)) from None
            warnings.warn(f"trustscope: step {step} not logged: {err}", LogWarning, stacklevel=2)
            return
        self._queue.put(("data", batch))

    def flush(self) -> None:
        """Block until everything logged so far is in finished Parquet files (renamed, visible to readers)."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()
        self._raise_writer_error()

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Flush, stop the writer thread and mark this rank ``status`` in its manifest. Safe to call twice."""
        if self._closed:
            return
        if status not in S.STATUSES:
            raise ValueError(f"status must be one of {S.STATUSES}, got {status!r}")
        done = threading.Event()
        self._queue.put(("stop", done))
        done.wait()
        self._thread.join()
        self._closed = True
        atexit.unregister(self._atexit)
        if self._error is not None and status == "finished":
            status, error = "crashed", f"write error: {self._error}"
        self._save_manifest(status=status, error=error, finished_at=_now())
        self._raise_writer_error()

    def __enter__(self) -> TokenLogger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close(status="crashed", error=f"{exc_type.__name__}: {exc}")
            except Exception as err:  # the original exception is the one to see
                warnings.warn(f"trustscope: closing the logger failed: {err}", LogWarning, stacklevel=2)

    @property
    def manifest(self) -> dict:
        """A copy of this rank's manifest as last written."""
        with self._lock:
            return json.loads(json.dumps(self._manifest, default=str))

    def _raise_writer_error(self) -> None:
        err, self._error = self._error, None
        if err is None:
            return
        if self.strict:
            raise LogDirError(f"trustscope could not write run {self.run_id!r}: {err}") from err
        warnings.warn(f"trustscope: a write of run {self.run_id!r} failed, its rows are lost: {err}",
                      LogWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------------ checking

    def _prepare(self, step: Any, tokens: Mapping[str, Any] | None, mask: Any, samples: Mapping[str, Any] | None,
                 scalars: Mapping[str, Any] | None, loss_rule: str | None) -> _Batch:
        step = self._check_step(step)
        loss_rule = self.loss_rule if loss_rule is None else loss_rule
        if not isinstance(loss_rule, str) or not loss_rule:
            raise _Rejected(f"loss_rule must be a non-empty string, got {loss_rule!r}")
        for what, given, allowed in (("tokens", tokens, TOKEN_INPUTS), ("samples", samples, SAMPLE_INPUTS)):
            unknown = sorted(set(given or {}) - set(allowed))
            if unknown:
                raise _Rejected(f"unknown column(s) {unknown} in {what}; allowed: {list(allowed)}")
        if mask is not None and tokens is None:
            raise _Rejected("mask given without tokens")
        batch = _Batch(step=step, loss_rule=loss_rule, tokens=None, samples=None,
                       scalars=self._check_scalars(scalars))
        new_ids: list[int] = []
        if tokens or samples:
            lengths = None
            if tokens:
                cols, b, t, lengths = _flatten_tokens(tokens, mask)
            n_seq = len(lengths) if lengths is not None else _n_samples(samples)
            sample_ids = self._sequence_ids(step, tokens, samples, n_seq)
            if samples:
                batch.samples = self._check_samples(samples, n_seq, lengths, sample_ids)
            if tokens:
                batch.tokens = self._check_tokens(step, cols, b, t, sample_ids, samples)
            new_ids = sample_ids["sample_id"].tolist()
        if step != self._last_step:
            self._step_sample_ids = set()
        self._step_sample_ids.update(new_ids)
        self._last_step = step
        return batch

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise _Rejected(f"step must be an int, got {step!r} ({type(step).__name__})")
        step = int(step)
        if step < 0:
            raise _Rejected(f"step must be >= 0, got {step}")
        if self._last_step is not None and step < self._last_step:
            raise _Rejected(f"step {step} goes backwards: step {self._last_step} was already logged")
        if self._last_step is None and self._disk_last_step is not None and step <= self._disk_last_step:
            raise _Rejected(f"step {step} is not after step {self._disk_last_step}, the last step of rank "
                            f"{self.rank} already on disk in resumed run {self.run_id!r}")
        return step

    @staticmethod
    def _check_scalars(scalars: Mapping[str, Any] | None) -> list[tuple[str, float]]:
        out = []
        for name, value in (scalars or {}).items():
            if not isinstance(name, str) or not name:
                raise _Rejected(f"scalar names must be non-empty strings, got {name!r}")
            try:
                out.append((name, float(value)))
            except (TypeError, ValueError):
                raise _Rejected(f"scalars[{name!r}] must be a number, got {value!r}") from None
        return out

    def _sequence_ids(self, step: int, tokens: Mapping[str, Any] | None, samples: Mapping[str, Any] | None,
                      n_seq: int) -> dict[str, np.ndarray]:
        """Per-sequence sample_id and prompt_id ``(B,)``, from tokens or samples; checked to agree and be unique."""
        ids: dict[str, np.ndarray] = {}
        for name in PER_SEQUENCE:
            found = []
            for what, given in (("tokens", tokens), ("samples", samples)):
                if given and name in given:
                    arr = _as_int(_to_numpy(given[name], f"{what}[{name!r}]"), f"{what}[{name!r}]").reshape(-1)
                    if arr.shape != (n_seq,):
                        raise _Rejected(f"{what}[{name!r}] must have one value per sample ({n_seq}), "
                                        f"got shape {arr.shape}")
                    found.append((what, arr))
            if len(found) == 2 and not np.array_equal(found[0][1], found[1][1]):
                i = int(np.flatnonzero(found[0][1] != found[1][1])[0])
                raise _Rejected(f"tokens[{name!r}] and samples[{name!r}] disagree at sample row {i}: "
                                f"{found[0][1][i]} vs {found[1][1][i]}")
            if found:
                ids[name] = found[0][1]
            elif name == "sample_id":
                ids[name] = np.arange(n_seq, dtype=np.int64)
            else:
                raise _Rejected("prompt_id is required: pass tokens['prompt_id'] or samples['prompt_id'] (B,)")
        sid = ids["sample_id"]
        if (sid < 0).any():
            raise _Rejected(f"sample_id must be >= 0, got {sid[sid < 0][0]}")
        uniq, counts = np.unique(sid, return_counts=True)
        if (counts > 1).any():
            raise _Rejected(f"sample_id {uniq[counts > 1][0]} appears twice in one call; sample_id must be unique "
                            f"within a step")
        if step == self._last_step:
            again = self._step_sample_ids.intersection(sid.tolist())
            if again:
                raise _Rejected(f"sample_id {min(again)} was already logged at step {self._last_step}")
        return ids

    def _check_samples(self, samples: Mapping[str, Any], n_seq: int, lengths: np.ndarray | None,
                       ids: dict[str, np.ndarray]) -> dict[str, Any]:
        out: dict[str, Any] = dict(ids)
        for name in ("prompt", "response", "finish_reason"):
            if name in samples:
                values = list(samples[name])
                if len(values) != n_seq:
                    raise _Rejected(f"samples[{name!r}] has {len(values)} value(s), expected one per sample ({n_seq})")
                bad = [v for v in values if v is not None and not isinstance(v, str)]
                if bad:
                    raise _Rejected(f"samples[{name!r}] must hold strings, got {bad[0]!r}")
                out[name] = values
        for name in ("reward", "advantage"):
            if name in samples:
                label = f"samples[{name!r}]"
                arr = _as_float(_to_numpy(samples[name], label), label).reshape(-1)
                if arr.shape != (n_seq,):
                    raise _Rejected(f"{label} must have one value per sample ({n_seq}), got shape {arr.shape}")
                if not np.isfinite(arr).all():
                    i = int(np.flatnonzero(~np.isfinite(arr))[0])
                    raise _Rejected(f"{label} must be finite, got {arr[i]} at sample_id {ids['sample_id'][i]}")
                out[name] = arr.copy()
        if "length" in samples:
            label = "samples['length']"
            length = _as_int(_to_numpy(samples["length"], label), label).reshape(-1)
            if length.shape != (n_seq,):
                raise _Rejected(f"{label} must have one value per sample ({n_seq}), got shape {length.shape}")
            if lengths is not None and (length != lengths).any():
                i = int(np.flatnonzero(length != lengths)[0])
                raise _Rejected(f"{label} is {length[i]} at sample_id {ids['sample_id'][i]}, but the mask (or the "
                                f"ragged token_id) gives length {lengths[i]}")
            if (length < 0).any():
                raise _Rejected(f"{label} must be >= 0, got {length[length < 0][0]}")
            out["length"] = length.astype(np.int32)
        elif lengths is not None:
            out["length"] = lengths.astype(np.int32)
        else:
            raise _Rejected("samples['length'] is required when no tokens are logged with the samples")
        return out

    def _check_tokens(self, step: int, cols: dict[str, np.ndarray], b: np.ndarray, t: np.ndarray,
                      ids: dict[str, np.ndarray], samples: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        """Check flat token rows; returns the columns of the rows to write (bad rows dropped when not strict)."""
        for name in ("mu_logprob", "pi_logprob"):
            if name not in cols:
                raise _Rejected(f"tokens[{name!r}] is required")
        if "advantage" not in cols:
            if samples is None or "advantage" not in samples:
                raise _Rejected("advantage is required: pass tokens['advantage'] ((B, T) or (B,)) or "
                                "samples['advantage'] (B,)")
            label = "samples['advantage']"
            cols["advantage"] = _as_float(_to_numpy(samples["advantage"], label), label).reshape(-1)[b]
        cols["sample_id"] = ids["sample_id"][b]
        cols["prompt_id"] = ids["prompt_id"][b]
        cols["pos"] = t
        sid = cols["sample_id"]
        check = _Checker(self.strict, len(b), lambda i: f"sample_id {sid[i]}, pos {t[i]}")

        tok = cols["token_id"] = _as_int(cols["token_id"], "tokens['token_id']", np.int32)
        upper = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int32).max
        if not _within(tok, 0, upper - 1):
            check.rows((tok >= 0) & (tok < upper), "tokens['token_id']", f"must be in [0, {upper})", tok)
        for name in (*S.LOGPROB_COLUMNS, *S.TOPK_LOGPROB_COLUMNS):
            if name not in cols:
                continue
            arr = cols[name] = _as_float(cols[name], f"tokens[{name!r}]")
            if not _within(arr, -np.inf, S.LOGPROB_TOLERANCE, finite=True):
                finite = np.isfinite(arr)
                check.rows(finite, f"tokens[{name!r}]", "must be finite", arr)
                check.rows(~finite | (arr <= S.LOGPROB_TOLERANCE), f"tokens[{name!r}]",
                           f"must be a log-probability (<= 0, tolerance {S.LOGPROB_TOLERANCE})", arr)
            if arr.size and arr.max() > 0:  # float rounding of log 1, within the tolerance: store 0
                np.minimum(arr, 0.0, out=arr)
        for name, low, high in (("advantage", -np.inf, np.inf), ("entropy", -S.LOGPROB_TOLERANCE, np.inf),
                                ("topk_tv", 0.0, 1.0 + 1e-6), ("topk_kl", -1e-6, np.inf)):
            if name in cols:
                arr = cols[name] = _as_float(cols[name], f"tokens[{name!r}]")
                if not _within(arr, low, high, finite=True):
                    what = "must be finite" if name == "advantage" else f"must be finite and in [{low}, {high}]"
                    check.rows(np.isfinite(arr) & (arr >= low) & (arr <= high), f"tokens[{name!r}]", what, arr)
        if "kept" in cols:
            kept = cols["kept"]
            if kept.dtype != np.bool_:
                check.rows(np.isin(kept, (0, 1)), "tokens['kept']", "must be boolean (or 0/1)", kept)
                cols["kept"] = kept.astype(bool)
        self._check_topk(cols, check)

        keep = ~check.bad
        if check.messages:
            self._dropped_rows += int(check.bad.sum())
            warnings.warn(f"trustscope: dropped {int(check.bad.sum())} token row(s): " + "; ".join(check.messages),
                          LogWarning, stacklevel=4)
        if self.token_fraction < 1.0:
            keep &= _keep_hash(self.seed, step, sid) < self.token_fraction
        if not keep.all():
            cols = {name: arr[keep] for name, arr in cols.items()}
        return cols

    def _check_topk(self, cols: dict[str, np.ndarray], check: _Checker) -> None:
        given = [name for name in S.TOPK_COLUMNS if name in cols]
        if not given:
            return
        if "mu_topk_ids" not in cols or "mu_topk_logprobs" not in cols:
            raise _Rejected(f"top-K needs both tokens['mu_topk_ids'] and tokens['mu_topk_logprobs'], got {given}")
        ks = {name: cols[name].shape[1] for name in given}
        k = ks["mu_topk_ids"]
        for name, kk in ks.items():
            if kk != k:
                raise _Rejected(f"tokens[{name!r}] has K = {kk}, but tokens['mu_topk_ids'] has K = {k}")
        if self._k is not None and k != self._k:
            raise _Rejected(f"tokens['mu_topk_ids'] has K = {k}, but this run logs K = {self._k}")
        if k < 1:
            raise _Rejected("tokens['mu_topk_ids'] has K = 0; leave the top-K columns out instead")
        self._k = k
        ids = cols["mu_topk_ids"] = _as_int(cols["mu_topk_ids"], "tokens['mu_topk_ids']", np.int32)
        upper = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int32).max
        if not _within(ids, 0, upper - 1):
            check.rows((ids >= 0) & (ids < upper), "tokens['mu_topk_ids']", f"must be in [0, {upper})", ids)

    # --------------------------------------------------------------------------------------------- writer thread

    def _write_loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            timeout = max(0.0, last_flush + self.flush_seconds - time.monotonic())
            try:
                kind, payload = self._queue.get(timeout=timeout)
            except queue.Empty:
                self._rotate()
                last_flush = time.monotonic()
                continue
            if kind == "data":
                try:
                    self._add(payload)
                except Exception as err:  # handed to the training thread at its next call
                    self._fail(err)
                due = time.monotonic() - last_flush >= self.flush_seconds
                if due or self._tables["tokens"].rows >= self.flush_rows:
                    self._rotate()
                    last_flush = time.monotonic()
            else:
                self._rotate()
                last_flush = time.monotonic()
                payload.set()
                if kind == "stop":
                    return

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        for table in self._tables.values():
            table.abort()

    def _add(self, batch: _Batch) -> None:
        if batch.tokens is not None and batch.n_tokens:
            self._tables["tokens"].add(self._tokens_table(batch), batch.step, self.run_dir / "tokens")
        if batch.samples is not None:
            self._tables["samples"].add(self._samples_table(batch), batch.step, self.run_dir / "samples")
        if batch.scalars:
            n = len(batch.scalars)
            steps = pa.table({
                "run_id": pa.repeat(pa.scalar(self.run_id), n),
                "step": pa.array(np.full(n, batch.step, np.int64)),
                "rank": pa.array(np.full(n, self.rank, np.int32)),
                "name": pa.array([name for name, _ in batch.scalars], pa.string()),
                "value": pa.array([value for _, value in batch.scalars], pa.float64()),
            }, schema=self._tables["steps"].schema)
            self._tables["steps"].add(steps, batch.step, self.run_dir / "steps")

    def _tokens_table(self, batch: _Batch) -> pa.Table:
        cols = batch.tokens
        assert cols is not None
        n = batch.n_tokens
        k = max((cols[name].shape[1] for name in S.TOPK_COLUMNS if name in cols), default=1)
        max_rows = (2**31 - 1) // max(k, 1) - 1  # list offsets are int32
        if n > max_rows:
            parts = [_Batch(batch.step, batch.loss_rule, {c: a[i: i + max_rows] for c, a in cols.items()}, None)
                     for i in range(0, n, max_rows)]
            return pa.concat_tables([self._tokens_table(part) for part in parts])
        if "mu_topk_logprobs" in cols and "pi_topk_logprobs" in cols and not {"topk_tv", "topk_kl"} <= set(cols):
            tv, kl = topk_divergences(cols["mu_topk_logprobs"], cols["pi_topk_logprobs"])
            cols.setdefault("topk_tv", tv)
            cols.setdefault("topk_kl", kl)
        out: dict[str, pa.Array] = {
            "run_id": pa.repeat(pa.scalar(self.run_id), n),
            "step": pa.array(np.full(n, batch.step, np.int64)),
            "rank": pa.array(np.full(n, self.rank, np.int32)),
        }
        for f in S.TOKENS:
            if f.name in out:
                continue
            if f.name == "loss_rule":
                out[f.name] = pa.repeat(pa.scalar(batch.loss_rule), n)
            elif f.name == "kept" and "kept" not in cols:
                out[f.name] = pa.array(np.ones(n, dtype=bool))
            elif f.name in S.TOPK_COLUMNS:
                values = cols.get(f.name)
                if values is None or not self.log_topk:
                    out[f.name] = pa.nulls(n, f.type)
                    continue
                if f.name != "mu_topk_ids" and self.topk_precision == "float16":
                    values = round_mantissa(values, 10)
                out[f.name] = _list_array(values, f.type.value_type)
            elif f.name in cols:
                out[f.name] = pa.array(cols[f.name].astype(f.type.to_pandas_dtype(), copy=False))
            else:
                out[f.name] = pa.nulls(n, f.type)
        return pa.table(out, schema=self._tables["tokens"].schema)

    def _samples_table(self, batch: _Batch) -> pa.Table:
        s = batch.samples
        assert s is not None
        n = len(s["sample_id"])
        out: dict[str, Any] = {
            "run_id": pa.repeat(pa.scalar(self.run_id), n),
            "step": pa.array(np.full(n, batch.step, np.int64)),
            "rank": pa.array(np.full(n, self.rank, np.int32)),
        }
        for f in S.SAMPLES:
            if f.name not in out:
                out[f.name] = pa.array(s[f.name], f.type) if f.name in s else pa.nulls(n, f.type)
        return pa.table(out, schema=self._tables["samples"].schema)

    def _rotate(self) -> None:
        """Finish every open file (rename to its final name) and record progress in the manifest."""
        flushed: dict[str, int] = {}
        last_step = None
        for name, table in self._tables.items():
            self._seq += 1
            pattern = f"r{self.rank:04d}-s{{first:08d}}-{{last:08d}}-{self._session}-{self._seq:05d}.parquet"
            step = table.last_step
            try:
                done = table.finish(self.run_dir / name, pattern, self.fsync)
            except Exception as err:
                self._fail(err)
                continue
            if done is not None:
                flushed[name] = done[1]
                last_step = step if last_step is None else max(last_step, step)
        if not flushed and self._manifest["logging"].get("topk_k") == self._k:
            return
        rows = dict(self._manifest.get("rows", {}))
        for name, count in flushed.items():
            rows[name] = rows.get(name, 0) + count
        prev = self._manifest.get("last_step")
        logging_info = {**self._manifest["logging"], "topk_k": self._k}
        try:
            self._save_manifest(rows=rows, logging=logging_info, dropped_rows=self._dropped_rows,
                                last_step=last_step if prev is None or (last_step or -1) > prev else prev)
        except Exception as err:
            self._fail(err)


def round_mantissa(values: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``values`` rounded to ``bits`` mantissa bits (10 = float16's precision), still float32.

    The low ``23 - bits`` mantissa bits become zero, which BYTE_STREAM_SPLIT + zstd then store almost for free.
    Unlike a cast to float16 the float32 exponent is kept: no overflow, no loss for tiny magnitudes.
    Rounds half away from zero (on the magnitude).
    """
    drop = 23 - bits
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    half, keep = np.uint32(1 << (drop - 1)), np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    rounded = np.where(finite, (u + half) & keep, u)
    return rounded.view(np.float32)


def topk_divergences(mu_topk_logprobs: np.ndarray, pi_topk_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-K TV and KL ``(N,)`` float32 from ``(N, K)`` logprob arrays, by :mod:`trustscope.divergence`.

    Computed in float64: in float32 the 'other' bucket ``1 - sum P`` is lost below about 1e-3, and its log-ratio
    term of the KL with it.
    """
    import torch

    from trustscope import divergence

    mu = torch.from_numpy(np.asarray(mu_topk_logprobs, dtype=np.float64))
    pi = torch.from_numpy(np.asarray(pi_topk_logprobs, dtype=np.float64))
    with torch.no_grad():
        tv, kl = divergence.topk_tv(mu, pi), divergence.topk_kl(mu, pi)
    return tv.numpy().astype(np.float32), kl.numpy().astype(np.float32)


def _n_samples(samples: Mapping[str, Any] | None) -> int:
    if not samples:
        return 0
    name, value = next(iter(samples.items()))
    try:
        return len(value)
    except TypeError:
        raise _Rejected(f"samples[{name!r}] must be a sequence with one value per sample, got {value!r}") from None


def _vocab_texts(vocab: Any) -> list[str]:
    """Token texts indexed by id from a list, a {id: text} dict or a Hugging Face tokenizer."""
    if isinstance(vocab, Mapping):
        size = max(vocab) + 1 if vocab else 0
        texts: list[Any] = [None] * size
        for i, text in vocab.items():
            texts[int(i)] = text
        return texts
    if isinstance(vocab, Sequence) and not isinstance(vocab, str):
        return list(vocab)
    if hasattr(vocab, "decode") and hasattr(vocab, "__len__"):
        return [vocab.decode([i]) for i in range(len(vocab))]
    raise TypeError(f"vocab must be a list of texts, a {{id: text}} dict or a tokenizer, got {type(vocab).__name__}")


def _jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (dataclasses and paths included); checked here so close() cannot fail on it."""
    if obj is None:
        return None
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        obj = asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: manifest is not a JSON object")
    return data


def _close_at_exit(logger: TokenLogger) -> Any:
    """An atexit hook that closes ``logger`` (as crashed: the program ended without close()) if still alive."""
    ref = weakref.ref(logger)

    def hook() -> None:
        lg = ref()
        if lg is not None and not lg._closed:
            with contextlib.suppress(Exception):  # nothing left to report to at exit
                lg.close(status="crashed", error="the process exited without TokenLogger.close()")

    return hook


# ------------------------------------------------------------------------------------------------------- status


def rank_statuses(run_dir: str | os.PathLike) -> dict[int, str]:
    """Effective status of every rank of a run: a ``running`` rank whose writer process is gone reads ``crashed``.

    A writer on another host cannot be checked from here and keeps ``running``.
    """
    run_dir = Path(run_dir)
    files = [run_dir / S.MANIFEST, *sorted((run_dir / S.RANKS_DIR).glob("rank*.json"))]
    out: dict[int, str] = {}
    host = socket.gethostname()
    for path in files:
        if not path.exists():
            continue
        m = _read_json(path)
        status = m.get("status", "running")
        if status == "running" and m.get("hostname") == host and isinstance(m.get("pid"), int):
            if not _pid_alive(m["pid"], m.get("pid_start")):
                status = "crashed"
        out[int(m.get("rank", 0))] = status
    if not out:
        raise SchemaError(f"{run_dir}: no run manifest")
    return out


def run_status(run_dir: str | os.PathLike) -> str:
    """Effective status of a run: ``crashed`` if any rank crashed, else ``running`` if any runs, else ``finished``."""
    statuses = set(rank_statuses(run_dir).values())
    for status in ("crashed", "running"):
        if status in statuses:
            return status
    return "finished"


class NullLogger:
    """A logger that logs nothing, with TokenLogger's methods: the trainer's logger when logging is off."""

    run_id = None
    run_dir = None
    rank = 0

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def log_step(
        self,
        step: int,
        tokens: Mapping[str, Any] | None = None,
        mask: Any = None,
        samples: Mapping[str, Any] | None = None,
        scalars: Mapping[str, Any] | None = None,
        loss_rule: str | None = None,
    ) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "finished", error: str | None = None) -> None:
        pass

    @property
    def manifest(self) -> dict:
        return {}

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
