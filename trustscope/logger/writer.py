"""The Arrow/Parquet writer: a background thread that turns checked batches into one file per table and flush,
and commits each flush in the rank's manifest (:meth:`RunFiles.commit`).

A flush closes and fsyncs every table's open temporary file (in the table folder, under a hidden name), records
its number as committed in the rank's manifest, and only then renames each file into the rank's folder under its
final name carrying the flush number (on an object store: uploads it under that name, one whole object). So no
reader of the folders ever lists a file the manifest does not commit: trustscope's readers and a plain glob of a
table see the same files at every moment, and each table's rows of the flush appear by one rename (or PUT).
The manifest names the flush's temporary and final files (``publishing``), so a writer killed between the commit
and the renames is rolled forward by the next writer of the rank (or ``trustscope validate --repair``).

Automatic flushes (``flush_rows`` rows or ``flush_seconds`` reached) happen when a new step begins, so they never
split a step; :meth:`Writer.flush` and an idle writer flush everything.

Failures never stop the thread: a batch that cannot be converted is lost alone; a file that cannot be written
loses the open flush; a manifest that cannot be written leaves its flushes invisible until a later commit
succeeds. What was lost is counted (the manifest's ``lost`` key) and the error is handed to the training thread
at its next call. Every wait on the thread ends when the thread is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import runformat as S
from trustscope.divergence_np import topk_divergences_np
from trustscope.logger.batch import Batch
from trustscope.logger.checks import ROUTING
from trustscope.logger.experts import DERIVED as ROUTING_DERIVED
from trustscope.logger.experts import KEEP as ROUTING_KEEP
from trustscope.logger.experts import derive as derive_routing
from trustscope.logger.memory import RowBudget
from trustscope.logger.summaries import summarize_call
from trustscope.runformat.fsops import can_exchange, exchange, fsync_file
from trustscope.runformat.runfiles import RunFiles
from trustscope.runformat.stores import RunStore


def default_write_threads() -> int:
    """How many files of the tokens table a flush encodes side by side by default: two where two cores are
    available to this process (measured in ``docs/performance.md``), else one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(2, cores)


POLL_S = 0.1
"""How often a wait on the writer thread checks that the thread is still alive."""
MAX_ERRORS_KEPT = 5


class _Part:
    """One of the temporary files a table's flush writes; its row groups are encoded on its own thread when the
    table has several parts (pyarrow releases the GIL while it encodes), so parts encode side by side."""

    def __init__(self, pool: ThreadPoolExecutor | None):
        self.pool = pool
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.busy: Future | None = None  # the row group being encoded (one at a time: bounded memory)
        self.rows = 0

    def wait(self) -> None:
        """Wait for the row group in flight; raises its error."""
        busy, self.busy = self.busy, None
        if busy is not None:
            busy.result()

    def write(self, table: _Table, data: pa.Table) -> None:
        self.wait()
        if self.writer is None:
            spool = table.store.spool(table.spool_dir)
            self.tmp = S.tmp_path(spool / f"{table.prefix}-open-{secrets.token_hex(6)}.parquet")
            self.writer = pq.ParquetWriter(self.tmp, table.schema, **table.options.writer_kwargs())
        self.rows += data.num_rows
        if self.pool is None:
            self.writer.write_table(data, row_group_size=table.row_group_size)
        else:
            self.busy = self.pool.submit(self.writer.write_table, data, row_group_size=table.row_group_size)


class _Table:
    """One table's open temporary files and its pending rows (writer thread only).

    Whole row groups go to the table's parts in turn; with ``parts > 1`` each part is a file encoded on its own
    thread, and a flush publishes one file per part that received rows.
    """

    def __init__(self, name: str, store: RunStore, directory: Path | PurePosixPath, row_group_size: int,
                 prefix: str, parts: int = 1, spool_dir: Path | PurePosixPath | None = None):
        self.name = name
        self.store = store
        self.directory = directory
        """Where the table's files land (the rank's folder, or the table folder in a layout 1 run)."""
        self.spool_dir = directory if spool_dir is None else spool_dir
        """Where they are written first (the table folder: outside the rank folder, which compaction swaps)."""
        self.prefix = prefix
        self.schema = S.with_metadata(name)
        self.options = S.WRITE_OPTIONS[name]
        self.row_group_size = row_group_size
        self._pools = [ThreadPoolExecutor(1, f"trustscope-encode-{name}-{i}") for i in range(parts)] \
            if parts > 1 else [None]
        self.parts = [_Part(pool) for pool in self._pools]
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.next_part = 0
        self.rows = 0  # rows in the open files, written or pending
        self.first_step: int | None = None
        self.last_step: int | None = None

    def add(self, table: pa.Table, step: int) -> None:
        if table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if self.pending_rows >= self.row_group_size:
            self._write_pending(whole_groups=True)

    def _write_pending(self, whole_groups: bool) -> None:
        data = pa.concat_tables(self.pending) if len(self.pending) > 1 else self.pending[0]
        keep = data.num_rows % self.row_group_size if whole_groups else 0
        for start in range(0, data.num_rows - keep, self.row_group_size):
            group = data.slice(start, min(self.row_group_size, data.num_rows - keep - start))
            self.parts[self.next_part].write(self, group)
            self.next_part = (self.next_part + 1) % len(self.parts)
        self.pending = [data.slice(data.num_rows - keep)] if keep else []
        self.pending_rows = keep

    def close_file(self, metadata: dict[str, str]) -> None:
        """Write what is pending, add ``metadata`` to every footer and close the temporary files (they keep their
        temporary names)."""
        if self.pending_rows:
            self._write_pending(whole_groups=False)
        for part in self.parts:
            part.wait()
        for part in self.parts:
            if part.writer is None:
                continue
            part.writer.add_key_value_metadata(metadata)
            part.writer.close()
            part.writer = None

    def finish(self, flush: int, rank: int) -> list[tuple[Path, Path | PurePosixPath, int]]:
        """The closed files as ``(temporary file, final name, rows)``, one per part that received rows; the table
        is ready for the next flush. Nothing is renamed here (see :meth:`Writer._publish`)."""
        assert self.first_step is not None and self.last_step is not None
        out = []
        for i, part in enumerate(p for p in self.parts if p.tmp is not None):
            assert part.tmp is not None
            final = self.directory / S.data_file_name(rank, self.first_step, self.last_step, flush,
                                                      i if len(self.parts) > 1 else None)
            out.append((part.tmp, final, part.rows))
            part.tmp = None
        self.reset()
        return out

    def abort(self) -> None:
        """Drop the open files and pending rows (after a write error); never raises."""
        for part in self.parts:
            with contextlib.suppress(Exception):  # the row group in flight is being thrown away
                part.wait()
            if part.writer is not None:
                with contextlib.suppress(Exception):  # the file is being thrown away
                    part.writer.close()
            if part.tmp is not None:
                with contextlib.suppress(OSError):  # the directory may have turned read-only
                    part.tmp.unlink(missing_ok=True)
        self.reset()

    def reset(self) -> None:
        for part in self.parts:
            part.writer, part.tmp, part.busy, part.rows = None, None, None, 0
        self.pending, self.pending_rows, self.next_part = [], 0, 0
        self.rows, self.first_step, self.last_step = 0, None, None

    def shutdown(self) -> None:
        """End the encoding threads (when the writer thread ends)."""
        for pool in self._pools:
            if pool is not None:
                pool.shutdown(wait=True)


@dataclass
class _Flush:
    """A flush whose files are closed (under their temporary names) but whose commit has not reached the manifest
    yet; its files are renamed into place once it has."""

    number: int
    rows: dict[str, int]
    first_step: int
    last_step: int
    counts: dict[str, int]
    files: list[tuple[Path, Path | PurePosixPath, int]]
    """``(temporary file, final name, rows)`` of each file."""


class _Constants:
    """Arrays that every batch repeats (the run id, the loss rule, list offsets), built once at the largest length
    seen and handed out as zero-copy slices."""

    def __init__(self) -> None:
        self._strings: dict[str, pa.Array] = {}
        self._offsets: dict[int, pa.Array] = {}

    def repeat(self, value: str, n: int) -> pa.Array:
        """``value`` ``n`` times, a string array."""
        have = self._strings.get(value)
        if have is None or len(have) < n:
            have = self._strings[value] = pa.repeat(pa.scalar(value, pa.string()), max(n, 2 * len(have or ())))
        return have.slice(0, n)

    def list_array(self, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
        """``(N, K)`` ``values`` as a list array over the same buffer (no copy)."""
        n, k = values.shape
        have = self._offsets.get(k)
        if have is None or len(have) < n + 1:
            rows = max(n, 2 * (len(have) - 1 if have is not None else 0))
            have = self._offsets[k] = pa.array(np.arange(0, (rows + 1) * k, k, dtype=np.int32))
        return pa.ListArray.from_arrays(have.slice(0, n + 1), pa.array(values.reshape(-1)),
                                        type=pa.list_(pa.field("element", value_type, nullable=False)))


class _StepSummaries:
    """The ``summaries`` rows of the open step's calls, merged before they are written: a trainer that calls
    ``log_step`` once per micro-batch would otherwise write a full set of rows per call (about 50 without top-K
    rules, several hundred with every rule and histogram). Every figure adds up by construction (counts, sums and
    sums of squares add, extremes take their min and max), so the ``summaries`` view reads the same figures from one
    row per (step, group) and flush. Rows are merged in call order, so two runs with the same calls merge alike.
    ``part`` is the first call merged; a flush in the middle of a step (idle, or an explicit ``flush()``) writes what
    is merged so far, and the step's later calls start a new set at their own part."""

    KEY = ("metric", "rule", "advantage_sign", "mu_low", "bin_low", "bin_high", "threshold", "dimension", "bucket")

    def __init__(self, step: int, part: int) -> None:
        self.step, self.part = step, part
        self.rows: dict[tuple, dict[str, Any]] = {}

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            key = tuple(map(row.get, self.KEY))
            have = self.rows.get(key)
            if have is None:
                self.rows[key] = dict(row)
                continue
            have["count"] += row["count"]
            for name in ("sum", "sum_sq"):
                if have.get(name) is not None and row.get(name) is not None:
                    have[name] += row[name]
            if row.get("min") is not None:
                have["min"] = row["min"] if have.get("min") is None else min(have["min"], row["min"])
            if row.get("max") is not None:
                have["max"] = row["max"] if have.get("max") is None else max(have["max"], row["max"])


def _batch_rows(batch: Batch) -> dict[str, int]:
    samples = 0 if batch.samples is None else len(batch.samples["sample_id"])
    return {"tokens": batch.n_tokens, "samples": samples, "steps": len(batch.scalars),
            "summaries": len(batch.summaries)}


class Writer:
    """The writer thread of one rank and the training thread's handle on it (``put``, ``flush``, ``stop``)."""

    def __init__(self, files: RunFiles, *, run_id: str, rank: int, log_topk: bool, topk_precision: str,
                 flush_rows: int, flush_seconds: float, max_queue: int, row_group_size: int, fsync: bool,
                 topk_k: int | None, write_threads: int = 1, blocked_rules: list[tuple[str, dict]] | None = None,
                 on_commit: Callable[[], None] | None = None, budget: RowBudget | None = None,
                 decode: Callable[[list[np.ndarray]], list[str]] | None = None, text_fraction: float = 1.0,
                 seed: int = 0, extra_fields: tuple[pa.Field, ...] = (), summary_rules: tuple | None = None):
        self.files = files
        self.budget = budget or RowBudget(2**62, max_queue, "block", None)
        """The rows and calls waiting in memory (:mod:`trustscope.logger.memory`): the training thread admits each
        batch against it, this thread releases the rows once their flush is stored and the calls as it takes them."""
        self._open_held = 0  # rows of the open flush still counted in the budget
        self._room_asked = threading.Event()
        self._on_commit = on_commit
        """Called on the writer thread after each commit (the background compaction counts them)."""
        self._summary_rules = summary_rules
        """The rule settings the summaries count (:func:`trustscope.logger.summaries.summary_rules`)."""
        self._bit_rules = tuple(name for name, _ in blocked_rules or ())
        """The rules whose blocks each token row records in ``blocked_rules`` (bit i: entry i), when summaries
        are computed; named with their parameters in every tokens file's footer."""
        self._bits_footer = ({S.BLOCKED_RULES_META: json.dumps([[n, p] for n, p in blocked_rules], default=str)}
                             if blocked_rules else {})
        self.run_id, self.rank = run_id, rank
        self._decode, self.text_fraction, self.seed = decode, text_fraction, seed
        """Token ids to texts (the logger's vocab), and the share of samples whose texts are kept."""
        self.routing_changed: Any = None
        """``(step, what)``, called on this thread when a call's lent routing buffer changed before it was read
        (:func:`trustscope.logger.experts.derive`); the logger records the incident."""
        self.log_topk, self.topk_precision = log_topk, topk_precision
        self.flush_rows, self.flush_seconds, self.fsync = flush_rows, flush_seconds, fsync
        self._k = topk_k
        self._constants = _Constants()
        # On an object store a table's flush is one object (one PUT, atomic for listers), never parts.
        parts = 1 if files.store.remote else write_threads
        self._can_swap = not files.store.remote and files.layout >= 2 and can_exchange(files.run_dir)
        self._tables = {t: _Table(t, files.store, files.data_dir(t), row_group_size, f"r{rank:04d}",
                                  parts if t == "tokens" else 1, spool_dir=files.run_dir / t) for t in S.TABLES}
        if extra_fields:  # the run's own per-token columns (TokenLogger(extra_columns=...)), after the built-in ones
            self._tables["tokens"].schema = S.with_metadata("tokens", pa.schema([*S.TOKENS, *extra_fields]))
        self._open_step: int | None = None
        self._open_counts = self._no_counts()
        self._step_summaries: _StepSummaries | None = None
        """The open step's summary rows, merged over its calls; written when the step ends or a flush comes."""
        self._uncommitted: list[_Flush] = []
        self._orphans: list[Path | PurePosixPath] = []
        self._uploaded: set[Path | PurePosixPath] = set()
        """Objects of uncommitted flushes already uploaded (object stores: uploaded first, committed after)."""
        """Files of a commit written back (they could not all be put in place) that could not be removed either:
        no commit may happen while they exist, since the next committed flush number would make them read."""
        self._lost_rows = dict.fromkeys(S.TABLES, 0)
        self._lost_steps: tuple[int, int] | None = None
        self._errors: list[str] = []
        self._error: BaseException | None = None  # not yet handed to the training thread
        self._fatal: BaseException | None = None  # what ended the thread, if not a stop
        self._queue: queue.Queue = queue.Queue()  # bounded by the budget (max_queue calls with data)
        self._summarised = threading.Condition()
        self._summarised_calls = 0  # calls with summaries the thread has taken (summarised, or lost)
        self._latest: tuple[int, list[dict[str, Any]]] | None = None  # the newest step's merged rows so far
        self._before: tuple[int, list[dict[str, Any]]] | None = None  # the step before it, whole
        self._carry: list[dict[str, Any]] = []  # the newest step's rows of an earlier flush (a flush cut it)
        self._part = 0
        self._thread = threading.Thread(target=self._run, name=f"trustscope-logger-r{rank}", daemon=True)
        self._thread.start()

    @staticmethod
    def _no_counts() -> dict[str, int]:
        return {"tokens_generated": 0, "tokens_logged": 0, "dropped_rows": 0}

    # ------------------------------------------------------------------------------------ training thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, batch: Batch) -> bool:
        """Queue ``batch`` (admitted by the budget); False when the thread is gone and it was not queued."""
        return self._put(("data", batch))

    def ask_room(self) -> None:
        """A caller waits for room (``on_full="block"``): when the thread comes to this request and the caller
        still waits, it stores its open flush, even in the middle of a step (a step larger than the bound)."""
        if not self._room_asked.is_set():
            self._room_asked.set()
            self._put(("room", None))

    def flush(self) -> None:
        """Wait until everything queued so far is committed, or the thread is gone."""
        done = threading.Event()
        if self._put(("flush", done)):
            self._wait(done)

    def commit(self) -> None:
        """Ask the thread to store and commit everything queued so far, without waiting for it (a step's end)."""
        self._put(("commit", None))

    def stop(self) -> None:
        """Flush, end the thread, and count what could not be committed as lost."""
        done = threading.Event()
        if self._put(("stop", done)):
            self._wait(done)
        while self._thread.is_alive():
            self._thread.join(POLL_S)
        self._drain_lost()

    def lose(self, batch: Batch) -> None:
        """Count a batch the training thread could not queue (the writer thread is gone) as lost, and any batch
        still queued with it."""
        self._lose(self._fatal or RuntimeError("the writer thread stopped"), _batch_rows(batch), batch.step,
                   batch.step)
        self.budget.release(batch.held_rows, 1)
        self._drain_lost()

    @property
    def fatal(self) -> BaseException | None:
        """What ended the writer thread before it was stopped, or None."""
        return self._fatal

    def take_error(self) -> BaseException | None:
        """The failure not yet reported to the training thread; once the thread is dead, always its cause."""
        err, self._error = self._error, None
        if err is None and not self._thread.is_alive():
            err = self._fatal
        return err

    @property
    def lost(self) -> dict[str, Any] | None:
        """What was lost to write failures: rows per table, the step span, the first errors; None if nothing."""
        if self._lost_steps is None and not any(self._lost_rows.values()):
            return None
        first, last = self._lost_steps or (None, None)
        return {"rows": dict(self._lost_rows), "first_step": first, "last_step": last,
                "errors": list(self._errors)}

    def step_summaries(self, done: Callable[[int, int], bool], queued: int,
                       wait_s: float) -> tuple[int, list[dict[str, Any]]] | None:
        """The merged summary rows of the newest step whose calls so far are all summarised, as ``(step, rows)``.

        ``queued``: the calls with summaries queued so far; ``done(step, summarised)``: whether every call of
        ``step`` queued so far is among the first ``summarised``. Waits up to ``wait_s`` for the thread to take
        the ``queued`` calls (never on a thread that is gone); then gives the newest step if it is whole, else the
        one before it (or None)."""
        deadline = time.monotonic() + wait_s
        with self._summarised:
            while self._summarised_calls < queued and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._summarised.wait(min(left, POLL_S))
            latest, before = self._latest, self._before
            if latest is not None and done(latest[0], self._summarised_calls):
                return latest
            return before

    def _summarised_call(self, batch: Batch) -> None:
        """Writer thread: a call with summaries was taken; publish its step's merged rows so far."""
        merged = self._step_summaries
        with self._summarised:
            self._summarised_calls += 1
            if merged is not None and merged.step == batch.step:
                if self._latest is not None and self._latest[0] != batch.step:
                    self._before, self._carry = self._latest, []
                elif self._latest is not None and merged.part != self._part:  # a flush cut the step
                    self._carry = self._latest[1]
                self._part = merged.part
                rows = [dict(row) for row in merged.rows.values()]
                if self._carry:  # the step's rows written by the earlier flush, added back
                    both = _StepSummaries(batch.step, 0)
                    both.add(self._carry)
                    both.add(rows)
                    rows = list(both.rows.values())
                self._latest = (batch.step, rows)
            self._summarised.notify_all()

    def _put(self, item: tuple[str, Any]) -> bool:
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _wait(self, done: threading.Event) -> None:
        while not done.wait(POLL_S):
            if not self._thread.is_alive():
                return

    # -------------------------------------------------------------------------------------- writer thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # the thread must not end silently: its cause goes to the next call
            self._fatal = err
            self._lose_open(err)
            self._give_up_uncommitted()
            self._drain_lost()
            with contextlib.suppress(Exception):  # readers see at once that nothing more will be written
                self.files.save(status="crashed", error=f"writer thread stopped: {type(err).__name__}: {err}",
                                lost=self.files.all_lost(self.lost))
        finally:
            for table in self._tables.values():
                table.shutdown()

    def _drain_lost(self) -> None:
        """Count the batches left on the queue of a thread that is gone as lost."""
        err = self._fatal or RuntimeError("the writer thread stopped")
        while True:
            try:
                kind, payload = self._queue.get_nowait()
            except queue.Empty:
                return
            if kind == "data":
                self._lose(err, _batch_rows(payload), payload.step, payload.step)
                self.budget.release(payload.held_rows, 1)

    def _loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            timeout = max(0.0, last_flush + self.flush_seconds - time.monotonic())
            try:
                kind, payload = self._queue.get(timeout=timeout)
            except queue.Empty:  # idle: flush everything, or at least show the writer is alive
                self._rotate(heartbeat=True)
                last_flush = time.monotonic()
                continue
            if kind == "data":
                self.budget.release(calls=1)
                due = (self._tables["tokens"].rows >= self.flush_rows
                       or time.monotonic() - last_flush >= self.flush_seconds)
                if due and self._open_step is not None and payload.step != self._open_step:
                    self._rotate()
                    last_flush = time.monotonic()
                self._add(payload)
                if time.monotonic() - self.files.saved_at >= self.flush_seconds:  # a long step: still alive
                    self._heartbeat()
            elif kind == "room":  # everything queued before it is in the open flush now
                self._room_asked.clear()
                if self._open_held and self.budget.caller_waits():
                    self._rotate()
                    last_flush = time.monotonic()
            else:
                self._rotate()
                last_flush = time.monotonic()
                if kind == "stop":
                    self._give_up_uncommitted()
                    payload.set()
                    return
                if payload is not None:  # a commit request ("commit") has no one waiting
                    payload.set()

    def _report(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        text = f"{type(err).__name__}: {err}"
        if len(self._errors) < MAX_ERRORS_KEPT and text not in self._errors:
            self._errors.append(text)

    def _lose(self, err: BaseException, rows: dict[str, int], first: int | None, last: int | None) -> None:
        self._report(err)
        for table, n in rows.items():
            self._lost_rows[table] += n
        if first is not None and last is not None:
            lo, hi = self._lost_steps or (first, last)
            self._lost_steps = (min(lo, first), max(hi, last))

    def _lose_open(self, err: BaseException) -> None:
        """Drop the open flush (its files could not be written)."""
        rows = {name: t.rows for name, t in self._tables.items()}
        firsts = [t.first_step for t in self._tables.values() if t.first_step is not None]
        lasts = [t.last_step for t in self._tables.values() if t.last_step is not None]
        for table in self._tables.values():
            table.abort()
        waiting, self._step_summaries = self._step_summaries, None  # the open flush's, not yet in its table
        if waiting is not None:
            rows["summaries"] += len(waiting.rows)
            firsts.append(waiting.step)
            lasts.append(waiting.step)
        self._open_counts = self._no_counts()
        self._open_step = None
        self._release_open()
        self._lose(err, rows, min(firsts, default=None), max(lasts, default=None))

    def _release_open(self) -> None:
        """The open flush is stored or lost: its rows leave the budget."""
        held, self._open_held = self._open_held, 0
        self.budget.release(held)

    def _add(self, batch: Batch) -> None:
        summarised = batch.summarize and batch.tokens is not None
        try:
            self._add_batch(batch)
        finally:
            if summarised:
                self._summarised_call(batch)

    def _add_batch(self, batch: Batch) -> None:
        try:
            parts = self._arrow(batch)
        except Exception as err:  # this batch alone is lost
            self._lose(err, _batch_rows(batch), batch.step, batch.step)
            self.budget.release(batch.held_rows)
            return
        self._open_held += batch.held_rows  # released with the open flush, stored or lost
        try:
            for name, table in parts.items():
                self._tables[name].add(table, batch.step)
            if batch.summaries:
                if self._step_summaries is not None and self._step_summaries.step != batch.step:
                    self._write_summaries()
                if self._step_summaries is None:
                    self._step_summaries = _StepSummaries(batch.step, batch.part)
                self._step_summaries.add(batch.summaries)
        except Exception as err:
            self._lose_open(err)
            return
        self._open_step = batch.step
        self._open_counts["tokens_generated"] += batch.n_generated
        self._open_counts["tokens_logged"] += batch.n_tokens
        self._open_counts["dropped_rows"] += batch.dropped_rows

    def _write_summaries(self) -> None:
        """Add the open step's merged summary rows to the open ``summaries`` file."""
        merged = self._step_summaries
        if merged is None:
            return
        table = self._summaries_table(merged) if merged.rows else None  # failing here, _lose_open counts them
        self._step_summaries = None
        if table is not None:
            self._tables["summaries"].add(table, merged.step)  # failing here, they count among the table's rows

    def _rotate(self, heartbeat: bool = False) -> None:
        """Finish the open files as one flush and commit it; with nothing open, retry a failed commit or (idle)
        update the manifest's ``updated_at``."""
        try:
            self._write_summaries()
        except Exception as err:
            self._lose_open(err)
            return
        open_tables = [t for t in self._tables.values() if t.rows]
        if not open_tables:
            self._release_open()  # rows all sampled out: nothing to store
            if self._uncommitted:
                self._commit()
            elif heartbeat:
                self._heartbeat()
            return
        number = self.files.next_flush
        rows = {t.name: t.rows for t in open_tables}
        first_step = min(t.first_step for t in open_tables if t.first_step is not None)
        last_step = max(t.last_step for t in open_tables if t.last_step is not None)
        try:
            footer = {S.FLUSH_META_PREFIX + k: str(v) for k, v in {"flush": number, **self._open_counts}.items()}
            for table in open_tables:
                table.close_file({**footer, **self._bits_footer} if table.name == "tokens" else footer)
            closed = [f for table in open_tables for f in table.finish(number, self.rank)]
        except Exception as err:
            self._lose_open(err)
            return
        self._release_open()
        self.files.next_flush += 1
        self._uncommitted.append(_Flush(number, rows, first_step, last_step, self._open_counts, closed))
        self._open_counts = self._no_counts()
        self._open_step = None
        self._commit()

    def _heartbeat(self) -> None:
        """Update the manifest's ``updated_at`` only, so readers can tell a live writer from a stale one."""
        try:
            self.files.save()
        except OSError as err:
            self._report(err)

    def _commit(self) -> None:
        """Record the closed flushes in the manifest, then rename their files into place (an object store: upload
        them, then record them); on a failed manifest write they stay invisible to trustscope's readers (local
        files: closed under their temporary names) and the commit is retried later.

        Files whose rename fails after the commit are removed again, with those of the same commit already in
        place, and the manifest is written back as before the commit: the flushes are lost (counted), and a reader
        that listed the folder in that moment saw them come and go (a disk failure; the one window)."""
        self._orphans = [path for path in self._orphans if not self._remove(path)]
        if self._orphans:
            return
        rows = {t: sum(f.rows.get(t, 0) for f in self._uncommitted) for t in S.TABLES}
        counts = {k: sum(f.counts[k] for f in self._uncommitted) for k in self._no_counts()}
        files = [f for flush in self._uncommitted for f in flush.files]
        self.files.note(buffer=self.budget.report())  # the bound's figures so far ride along
        m = self.files.manifest
        before = {k: m.get(k) for k in ("rows", "last_step", "committed_flush", "tokens_generated", "tokens_logged",
                                        "dropped_rows")}
        if self.files.store.remote:
            # An object store: each flush's objects are uploaded first (each appears whole or not at all), then the
            # manifest commits them. A PUT whose reply is lost may have committed them; either way the objects stay
            # and the next commit covers them. Killed in between, the objects are ones no manifest commits: never
            # read by trustscope, named by validate, removed by the next writer (the one window a tool listing the
            # prefix has; the logger does not compact on object stores, so it has no other).
            try:
                self._publish([f for f in files if f[1] not in self._uploaded])
            except Exception as err:  # past the store's retries: these flushes are lost, their objects removed
                self._uploaded.clear()
                self._unpublish(files, before, err)
                return
            self._uploaded.update(f[1] for f in files)
            try:
                self.files.commit(self._uncommitted[-1].number, rows, max(f.last_step for f in self._uncommitted),
                                  counts, self._k, self.lost)
            except Exception as err:
                self._report(err)
                return
            self._uploaded.clear()
        else:
            with self.files.folder_lock:  # a compaction lists the committed flushes under it: all in place or none
                try:
                    self.files.commit(self._uncommitted[-1].number, rows,
                                      max(f.last_step for f in self._uncommitted), counts, self._k, self.lost,
                                      publishing=files)
                except Exception as err:
                    self._report(err)
                    return
                try:
                    self._publish(files)
                except Exception as err:
                    self._unpublish(files, before, err)
                    return
        self._uncommitted.clear()
        if self._on_commit is not None:
            self._on_commit()

    def _remove(self, path: Path | PurePosixPath) -> bool:
        """Remove a file of a failed flush; returns whether it is gone (the error is reported if not)."""
        try:
            self.files.store.delete(path)
        except OSError as err:
            self._report(err)
            return False
        return True

    def _publish(self, files: list[tuple[Path, Path | PurePosixPath, int]]) -> None:
        """Rename (upload) committed files into place; the caller holds the rank folder's lock (a compaction
        swapping the folder meanwhile would take a file renamed into it along with the old folder). Several files bound for one
        rank folder (a flush's parts) land together, by a swap of the folder, where the file system can swap."""
        by_folder: dict[Any, list[tuple[Path, Path | PurePosixPath, int]]] = {}
        for f in files:
            by_folder.setdefault(f[1].parent, []).append(f)
        for folder, group in by_folder.items():
            if len(group) > 1 and self._can_swap:
                publish_together(self.files.run_dir, folder, [(tmp, final) for tmp, final, _ in group], self.fsync)
                continue
            for tmp, final, _ in group:
                self.files.store.publish(tmp, final, self.fsync)

    def _unpublish(self, files: list[tuple[Path, Path | PurePosixPath, int]], before: dict,
                   err: BaseException) -> None:
        """A commit whose files could not all be put in place: remove them and write the manifest back."""
        self._report(err)
        for tmp, final, _ in files:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if not self._remove(final):
                self._orphans.append(final)  # retried before every commit
        for f in self._uncommitted:
            self._lose(err, f.rows, f.first_step, f.last_step)
        self.files.next_flush = min(f.number for f in self._uncommitted)  # the latest flushes: numbers reused
        self._uncommitted.clear()
        try:
            self.files.save(**before, publishing=[], lost=self.files.all_lost(self.lost))
        except OSError as again:
            self._report(again)

    def _give_up_uncommitted(self) -> None:
        """At the end: flushes whose commit never succeeded are lost; their temporary files are removed."""
        err = self._error or self._fatal or RuntimeError("the manifest could not be updated")
        for f in self._uncommitted:
            for tmp, _, _ in f.files:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            self._lose(err, f.rows, f.first_step, f.last_step)
        self._uncommitted.clear()

    # ---------------------------------------------------------------------------------- Arrow conversion

    def _arrow(self, batch: Batch) -> dict[str, pa.Table]:
        """The batch's rows of every table as Arrow, all converted before any is added."""
        out = {}
        if batch.routing is not None and batch.tokens is not None:  # over every row, before the sample too
            changed = derive_routing(batch.tokens, batch.step, batch.routing)
            if changed and self.routing_changed is not None:
                self.routing_changed(batch.step, changed)
        if batch.summarize and batch.tokens is not None:  # over every token row, before the token_fraction sample
            batch.summaries = summarize_call(batch.tokens, self._bit_rules, step=batch.step,
                                             rules=self._summary_rules)
        batch.summarize = False
        batch.apply_sample()
        if batch.tokens is not None and batch.n_tokens:
            out["tokens"] = self._tokens_table(batch)
            if "mu_topk_ids" in batch.tokens:
                self._k = int(batch.tokens["mu_topk_ids"].shape[1])
        if batch.samples is not None:
            out["samples"] = self._samples_table(batch)
        if batch.scalars:
            n = len(batch.scalars)
            out["steps"] = pa.table({
                "run_id": pa.repeat(pa.scalar(self.run_id), n),
                "step": pa.array(np.full(n, batch.step, np.int64)),
                "rank": pa.array(np.full(n, self.rank, np.int32)),
                "name": pa.array([name for name, _ in batch.scalars], pa.string()),
                "value": pa.array([value for _, value in batch.scalars], pa.float64()),
            }, schema=self._tables["steps"].schema)
        return out

    def _tokens_table(self, batch: Batch) -> pa.Table:
        cols = batch.tokens
        assert cols is not None
        n = batch.n_tokens
        k = max((arr.shape[1] for arr in cols.values() if arr.ndim == 2), default=1)  # the longest list column
        max_rows = (2**31 - 1) // max(k, 1) - 1  # list offsets are int32
        if n > max_rows:
            parts = [Batch(batch.step, batch.loss_rule, {c: a[i: i + max_rows] for c, a in cols.items()}, None)
                     for i in range(0, n, max_rows)]
            return pa.concat_tables([self._tokens_table(part) for part in parts])
        if "mu_topk_logprobs" in cols and "pi_topk_logprobs" in cols and not {"topk_tv", "topk_kl"} <= set(cols):
            tv, kl = topk_divergences_np(cols["mu_topk_logprobs"], cols["pi_topk_logprobs"])  # summaries=False
            cols.setdefault("topk_tv", tv)
            cols.setdefault("topk_kl", kl)
        out: dict[str, pa.Array] = {
            "run_id": self._constants.repeat(self.run_id, n),
            "step": pa.array(np.full(n, batch.step, np.int64)),
            "rank": pa.array(np.full(n, self.rank, np.int32)),
        }
        for f in self._tables["tokens"].schema:
            if f.name in out:
                continue
            if f.name == "loss_rule":
                out[f.name] = self._constants.repeat(batch.loss_rule, n)
            elif f.name == "kept" and "kept" not in cols:
                out[f.name] = pa.array(np.ones(n, dtype=bool))
            elif f.name in S.TOPK_COLUMNS:
                values = cols.get(f.name)
                if values is None or not self.log_topk:
                    out[f.name] = pa.nulls(n, f.type)
                    continue
                if f.name != "mu_topk_ids" and self.topk_precision == "float16":
                    values = round_mantissa(values, 10)
                out[f.name] = self._constants.list_array(values, f.type.value_type)
            elif f.name in ROUTING and f.name in cols:  # (N, L, k) -> L * k ids a row, layer by layer
                out[f.name] = routing_lists(cols[f.name], cols.get(ROUTING_KEEP), f.type.value_type,
                                            self._constants)
            elif f.name in ROUTING_DERIVED and f.name in cols and cols[f.name].dtype.kind == "f":
                out[f.name] = pa.array(cols[f.name], f.type, from_pandas=True)  # NaN: no engine routing, null
            elif f.name in cols and pa.types.is_list(f.type):  # a list per token, (N, L)
                out[f.name] = self._constants.list_array(cols[f.name], f.type.value_type)
            elif f.name in cols:
                out[f.name] = pa.array(cols[f.name].astype(f.type.to_pandas_dtype(), copy=False))
            else:
                out[f.name] = pa.nulls(n, f.type)
        return pa.table(out, schema=self._tables["tokens"].schema)

    def _summaries_table(self, merged: _StepSummaries) -> pa.Table:
        rows = list(merged.rows.values())
        n = len(rows)
        given = {"run_id": [self.run_id] * n, "step": [merged.step] * n, "rank": [self.rank] * n,
                 "part": [merged.part] * n}
        columns = {f.name: given.get(f.name) or [row.get(f.name) for row in rows] for f in S.SUMMARIES}
        return pa.table(columns, schema=self._tables["summaries"].schema)

    def _samples_table(self, batch: Batch) -> pa.Table:
        s = batch.samples
        assert s is not None
        n = len(s["sample_id"])
        out: dict[str, Any] = {
            "run_id": pa.repeat(pa.scalar(self.run_id), n),
            "step": pa.array(np.full(n, batch.step, np.int64)),
            "rank": pa.array(np.full(n, self.rank, np.int32)),
        }
        texts = self._texts(batch.step, s, n)
        for f in S.SAMPLES:
            if f.name in texts:
                out[f.name] = pa.array(texts[f.name], f.type)
            elif f.name not in out:
                out[f.name] = pa.array(s[f.name], f.type) if f.name in s else pa.nulls(n, f.type)
        return pa.table(out, schema=self._tables["samples"].schema)

    def _texts(self, step: int, s: dict[str, Any], n: int) -> dict[str, list[str | None]]:
        """The prompt and response texts the ``text_fraction`` sample keeps (the others None), decoded here from
        token ids where the call gave ids (:data:`trustscope.logger.checks.TEXT_IDS`)."""
        from trustscope.logger.checks import TEXT_IDS
        from trustscope.logger.sampling import keep_hash

        keep = (np.flatnonzero(keep_hash(self.seed, step, np.asarray(s["sample_id"])) < self.text_fraction)
                if self.text_fraction < 1.0 else np.arange(n))
        out: dict[str, list[str | None]] = {}
        for ids_name, name in TEXT_IDS.items():
            texts: list[str | None] = [None] * n
            if ids_name in s and self._decode is not None:
                for i, text in zip(keep, self._decode([s[ids_name][i] for i in keep]), strict=True):
                    texts[i] = text
            elif name in s and self.text_fraction < 1.0:
                for i in keep:
                    texts[i] = s[name][i]
            else:
                continue
            out[name] = texts
        return out


def routing_lists(values: np.ndarray, keep: np.ndarray | None, value_type: pa.DataType,
                  constants: _Constants) -> pa.ListArray:
    """``(N, L, k)`` expert ids as a list column of ``L * k`` ids a row, null outside ``keep`` ``(N,)`` (the rows
    that keep their lists, :func:`trustscope.logger.experts.derive`) and on rows of -1 (no routing reported)."""
    n = len(values)
    flat = values.reshape(n, -1)  # (N, L * k)
    present = flat[:, 0] >= 0 if keep is None else keep & (flat[:, 0] >= 0)
    if present.all():
        return constants.list_array(flat, value_type)
    width = flat.shape[1]
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(present * width, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat[present].reshape(-1)),
                                    type=pa.list_(pa.field("element", value_type, nullable=False)),
                                    mask=pa.array(~present))


def publish_together(run_dir: Path, folder: Path, files: list[tuple[Path, Path]], fsync: bool) -> None:
    """Put several closed files into the rank folder ``folder`` in one atomic step: a copy of the folder is staged
    (hard links to its files, and to the new ones) under ``<run>/_staging/`` and swapped with it
    (:func:`trustscope.runformat.fsops.exchange`); the temporaries are removed after. A reader lists all of them or
    none."""
    stage = run_dir / S.STAGING_DIR / f"{folder.parent.name}-{folder.name}-publish"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        for name in os.listdir(folder):
            os.link(folder / name, stage / name)
        for tmp, final in files:
            if fsync:
                fsync_file(tmp)
            os.link(tmp, stage / final.name)
        exchange(stage, folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the old folder, after the swap: links only
    for tmp, _ in files:
        with contextlib.suppress(OSError):
            tmp.unlink()


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

