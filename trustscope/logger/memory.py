"""The bound on the logger's memory (``max_buffered_rows``) and what ``log_step`` does when it is reached
(``on_full``).

Token rows count against the bound from the moment ``log_step`` queues them until the flush that holds them is
stored (its files written and renamed, or uploaded) or lost; at most ``max_queue`` calls with data wait on the queue.
When a call does not fit, ``on_full="block"`` makes ``log_step`` wait for room, up to ``block_timeout_s``, and then
falls through to ``"drop"``: the call's trailing whole sequences (token rows and sample rows) that do not fit are
dropped, its scalars are kept. What was dropped is counted (``dropped_rows`` and the manifest's ``buffer`` key) and
warned about. A call larger than the bound keeps the leading sequences that fit.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from trustscope.logger.batch import Batch
from trustscope.runformat.errors import LogWarning

ON_FULL = ("block", "drop")
DEFAULT_FLUSHES_BUFFERED = 4
"""The default ``max_buffered_rows``: this many flushes of ``flush_rows``, and never under
:data:`MIN_DEFAULT_ROWS`."""
MIN_DEFAULT_ROWS = 4_000_000
WARN_EVERY_S = 30.0
"""After the first drop, a warning at most this often (each one gives the totals so far)."""
POLL_S = 0.1


def default_max_buffered_rows(flush_rows: int) -> int:
    return max(DEFAULT_FLUSHES_BUFFERED * int(flush_rows), MIN_DEFAULT_ROWS)


def _no_counts() -> dict[str, Any]:
    return {"blocked_calls": 0, "blocked_s": 0.0, "dropped_calls": 0, "dropped_sequences": 0, "dropped_rows": 0,
            "first_dropped_step": None, "last_dropped_step": None, "peak_rows": 0}


class RowBudget:
    """Token rows and calls waiting in memory, shared by the training thread (:meth:`admit`) and the writer thread
    (:meth:`release`)."""

    def __init__(self, max_rows: int, max_calls: int, on_full: str, block_timeout_s: float | None,
                 prior: dict | None = None):
        self.max_rows, self.max_calls = max_rows, max_calls
        self.on_full, self.block_timeout_s = on_full, block_timeout_s
        self.rows = 0  # token rows queued or in the open flush, not yet stored
        self.calls = 0  # calls on the queue
        self._cond = threading.Condition()
        self._counts = _no_counts()
        self._prior = {**_no_counts(), **(prior or {})}  # an earlier session's (resume), added to ours
        self._warned_at: float | None = None
        self._wanted: int | None = None  # the rows a blocked caller waits for room for

    # ------------------------------------------------------------------------------------ training thread

    def admit(self, batch: Batch, alive: Callable[[], bool], ask_room: Callable[[], None]) -> bool:
        """Count ``batch`` against the bound, first waiting (``block``) or dropping its trailing sequences that do
        not fit; returns whether anything changed that the manifest should record."""
        n = 0 if batch.tokens is None else len(batch.tokens["token_id"])
        with self._cond:
            if batch.tokens is None and batch.samples is None:  # scalars alone: always queued
                self._take(batch, 0)
                return False
            want = min(n, self.max_rows)
            why = None
            if self._has_room(n):
                self._take(batch, n)
                return False
            if not self._has_room(want):
                if self.on_full == "block":
                    started = time.monotonic()
                    deadline = None if self.block_timeout_s is None else started + self.block_timeout_s
                    self._wanted = want
                    try:
                        while not self._has_room(want) and alive():
                            ask_room()
                            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
                            if left <= 0:
                                break
                            self._cond.wait(left)
                    finally:
                        self._wanted = None
                    waited = time.monotonic() - started
                    self._counts["blocked_calls"] += 1
                    self._counts["blocked_s"] += waited
                    if not self._has_room(want) and alive():
                        why = (f"log_step waited block_timeout_s={self.block_timeout_s} s for room and the store "
                               f"is still behind")
                elif alive():
                    why = "the store is behind (on_full='drop')"
            if not alive():  # the writer is gone: the batch is counted lost by the caller
                self._take(batch, n)
                return False
            room = self.max_rows - self.rows if self.calls < self.max_calls else 0
            if n > room and why is None:
                why = f"the call's {n} token rows alone exceed max_buffered_rows={self.max_rows}"
            if n > room or self.calls >= self.max_calls:
                self._drop(batch, max(room, 0), why or "the buffer is full")
            self._take(batch, 0 if batch.tokens is None else len(batch.tokens["token_id"]))
            return True

    def _has_room(self, rows: int) -> bool:
        return self.rows + rows <= self.max_rows and self.calls < self.max_calls

    def _take(self, batch: Batch, rows: int) -> None:
        batch.held_rows = rows
        self.rows += rows
        self.calls += 1
        self._counts["peak_rows"] = max(self._counts["peak_rows"], self.rows)

    def _drop(self, batch: Batch, room: int, why: str) -> None:
        """Drop the trailing whole sequences of ``batch`` whose token rows do not fit in ``room`` (all of them when
        the queue is full); its scalars stay."""
        sids, rows_per = _sequences(batch)
        keep = int(np.searchsorted(np.cumsum(rows_per), room, side="right")) if room else 0
        if self.calls >= self.max_calls:
            keep = 0
        kept_rows = int(rows_per[:keep].sum())
        gone_rows = int(rows_per.sum()) - kept_rows
        gone = len(sids) - keep
        if gone == 0:
            return
        if batch.tokens is not None:
            batch.tokens = {name: arr[:kept_rows] for name, arr in batch.tokens.items()}
            if batch.sampled is not None:
                batch.sampled = batch.sampled[:kept_rows]
            if not kept_rows:
                batch.tokens = None
        if batch.samples is not None:
            batch.samples = {name: value[:keep] for name, value in batch.samples.items()} if keep else None
        batch.dropped_rows += gone_rows
        c = self._counts
        c["dropped_calls"] += 1
        c["dropped_sequences"] += gone
        c["dropped_rows"] += gone_rows
        c["first_dropped_step"] = batch.step if c["first_dropped_step"] is None else c["first_dropped_step"]
        c["last_dropped_step"] = batch.step
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            total = self.report()
            warnings.warn(f"trustscope: dropped {gone} of {len(sids)} sequence(s) ({gone_rows} token rows) of step "
                          f"{batch.step}: {why}; {total['dropped_rows']} token rows dropped so far (run.json "
                          f"'buffer'). {self.rows} of max_buffered_rows={self.max_rows} rows are waiting to be "
                          f"stored; raise max_buffered_rows, or use on_full='block' to slow the trainer instead",
                          LogWarning, stacklevel=4)

    # -------------------------------------------------------------------------------------- writer thread

    def caller_waits(self) -> bool:
        """Whether a blocked caller still waits for room that only storing the open flush can give."""
        with self._cond:
            return self._wanted is not None and not self._has_room(self._wanted)

    def release(self, rows: int = 0, calls: int = 0) -> None:
        """``rows`` token rows are stored (or lost), ``calls`` calls left the queue."""
        if not rows and not calls:
            return
        with self._cond:
            self.rows -= rows
            self.calls -= calls
            self._cond.notify_all()

    # --------------------------------------------------------------------------------------------- report

    def report(self) -> dict[str, Any]:
        """The manifest's ``buffer`` key: the bound, the policy, and what it did (over resumed sessions too)."""
        c, p = self._counts, self._prior
        steps = [s for s in (p["first_dropped_step"], c["first_dropped_step"]) if s is not None]
        lasts = [s for s in (p["last_dropped_step"], c["last_dropped_step"]) if s is not None]
        return {"max_buffered_rows": self.max_rows, "on_full": self.on_full, "block_timeout_s": self.block_timeout_s,
                "blocked_calls": p["blocked_calls"] + c["blocked_calls"],
                "blocked_s": round(p["blocked_s"] + c["blocked_s"], 3),
                "dropped_calls": p["dropped_calls"] + c["dropped_calls"],
                "dropped_sequences": p["dropped_sequences"] + c["dropped_sequences"],
                "dropped_rows": p["dropped_rows"] + c["dropped_rows"],
                "first_dropped_step": min(steps, default=None), "last_dropped_step": max(lasts, default=None),
                "peak_rows": max(p["peak_rows"], c["peak_rows"])}


def _sequences(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """The call's sequences in order: (sample ids, token rows of each). Token rows are
    grouped by sequence in call order (the checks flatten them so), so a prefix of the sequences is a prefix of
    the rows."""
    rows_sid = None if batch.tokens is None else batch.tokens["sample_id"]
    if rows_sid is not None and len(rows_sid):
        starts = np.r_[0, np.flatnonzero(rows_sid[1:] != rows_sid[:-1]) + 1]
        group_rows = np.diff(np.r_[starts, len(rows_sid)])
        group_ids = rows_sid[starts]
    else:
        group_rows, group_ids = np.zeros(0, np.int64), np.zeros(0, np.int64)
    if batch.samples is None:
        return group_ids, group_rows
    sids = np.asarray(batch.samples["sample_id"])
    rows_per = np.zeros(len(sids), np.int64)
    if len(group_ids):
        order = np.argsort(sids, kind="stable")
        pos = order[np.searchsorted(sids[order], group_ids)]
        rows_per[pos] = group_rows
    return sids, rows_per
