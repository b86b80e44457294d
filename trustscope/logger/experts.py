"""Routed experts on the writer thread: what a call's expert lists become before they are written.

A mixture-of-experts token carries up to three ``(L, k)`` lists of expert ids (``engine_experts``: the rollout
engine's; ``trainer_experts``: the experts the trainer's forward used; ``router_experts``: the trainer router's own
pick, which differs from the experts used under routing replay). At production shapes they are most of a token
row's bytes: Qwen3-30B-A3B routes 48 MoE layers x top-8 of 128 experts, 336 bytes a side at the ids' entropy,
against the ~166 bytes the rest of a row takes (``docs/moe.md`` has the measurements). So the writer thread reduces
them, over every token handed to ``log_step``, to a few small per-token columns that carry what the analysis reads:

- ``routing_agreement``: the share of the engine's (layer, slot) choices the trainer's experts share.
- ``routing_first_layer``: the first MoE layer where they differ (-1: none; -2: the engine reported no routing for
  the token, a fallback).
- ``routing_replaced``: the share of the router's own choices the replay replaced by the engine's (the replace
  rate, 1 - agreement of the engine's with the router's own).
- ``routing_fault``: bits of :data:`FAULTS` (the token's engine routing missing, its sample's engine routing one
  position off the router's own, or repeating another sample's).

and keeps the full lists on a sampled share of the rows (:func:`default_fraction`, ``TokenLogger(routing_fraction=
...)``, by sample, so a kept response keeps every position) and on every row with a fault. The exact summaries
(:func:`trustscope.logger.summaries.routing_rows`) see every token, so no figure depends on the share kept.

The lists are the one input too large to copy on the caller's thread (3 GiB for a 2M-token step at Qwen3-30B-A3B's
shape, both sides), so ``log_step`` lends them (:class:`Lent`): it keeps a reference to the caller's buffer, and the
writer thread reads it, gathers the masked rows, derives the figures above and copies the kept share's rows. A
buffer the caller still owns is guarded: a sample of its rows, and a torch tensor's version counter, are read
again once the writer is through with it; a buffer changed before then (a framework that refills it) loses that
call's routing, never silently (the ``routing_buffer_changed`` incident), and the logger copies routing at the call
from then on.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import numpy as np

from trustscope.logger.sampling import keep_hash

SIDES = ("engine_experts", "trainer_experts", "router_experts")
"""The routed-expert list columns, ``(N, L, k)`` int16 in a call's columns."""

DERIVED = ("routing_agreement", "routing_first_layer", "routing_replaced", "routing_fault")
"""The per-token columns the writer derives from the lists."""

KEEP = "_routing_keep"
"""The key, in a batch's token columns, of the ``(N,)`` bool rows whose lists are written (the rest: null)."""

FAULTS = {"fallback": 1, "shifted": 2, "reused": 4}
"""``routing_fault`` bits: ``fallback`` the engine reported no routing for the token (its ``engine_experts`` row all
-1); ``shifted`` the token's response has engine experts that agree with the router's own pick one position away
better than at their own position (a replay buffer shifted by one); ``reused`` the response's engine experts equal
another response's of the call whose tokens differ before the last (a replay buffer reused across samples)."""

LIST_BYTES = 16.0
"""Bytes a token the default share of full expert lists costs on average (both sides, at the ids' entropy)."""

REUSED_MIN_BITS = 32.0
"""A response's engine routing is compared with the others' for ``reused`` only when it holds at least this many
bits of choice (its rows x MoE layers x log2(C(experts, top-k))): below that, two responses' lists can match by
chance (a one-token answer of a four-expert, top-2, two-layer model holds 5.2 bits), which is not a reused
buffer."""

SHIFT_MIN = 0.5
"""A response is ``shifted`` when its engine experts share at least this share of the router's own choices one
position away, and more than at their own position (unrelated routings share about ``k / experts``)."""

SHIFT_POSITIONS = 32
"""The positions of a response the shift check compares (its first ones): enough evidence, a bounded cost."""

CHUNK = 1 << 13
"""Rows compared at a time (keeps the ``(rows, L, k)`` temporaries in cache)."""

PROBE_ROWS = 256
"""Token rows of a lent buffer the guard reads at the call and again after the writer's read (:class:`Lent`)."""


class Lent:
    """One routing column the caller lent ``log_step`` instead of a copy: ``base`` is the caller's ``(N, L, k)``
    array (``index`` a slice of its rows) or ``(B, T, L, k)`` (``index`` the ``(b, t)`` rows the mask keeps,
    gathered on the writer thread). ``guard``: the buffer is the caller's, which it may reuse: :meth:`changed`
    reads :data:`PROBE_ROWS` rows again, and a torch tensor's version counter (bumped by every in-place write), and
    says whether they differ from what they were at the call. Without it (a tensor copied off its device, a
    :func:`handoff`) the buffer is the logger's alone.

    Limit: a change to a few ids outside the probed rows of a numpy buffer goes unseen; a refilled buffer changes
    the probed rows too."""

    __slots__ = ("base", "index", "owner", "probe", "probe_at", "version")

    def __init__(self, base: np.ndarray, index: slice | tuple[np.ndarray, np.ndarray], owner: object = None,
                 guard: bool = True):
        self.base, self.index, self.owner = base, index, owner
        self.version = getattr(owner, "_version", None) if guard else None
        self.probe_at: tuple | None = None
        self.probe: np.ndarray | None = None
        if not guard:
            return
        n = len(self)
        at = np.linspace(0, max(n - 1, 0), min(n, PROBE_ROWS)).astype(np.int64)  # rows of the call, spread
        if isinstance(index, slice):
            start, _, stride = index.indices(len(base))
            self.probe_at = (start + at * stride,)
        else:
            self.probe_at = (index[0][at], index[1][at])
        self.probe = base[self.probe_at].copy()

    def __len__(self) -> int:
        return len(range(len(self.base))[self.index]) if isinstance(self.index, slice) else len(self.index[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.base.shape[-2:])

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    ndim = 3

    def __getitem__(self, key: object) -> Lent | np.ndarray:
        """A slice of the rows stays lent (the memory budget's cut); any other index reads the rows now."""
        if isinstance(key, slice):
            if isinstance(self.index, slice):
                r = range(len(self.base))[self.index][key]
                index: slice | tuple = slice(r.start, r.stop, r.step)
            else:
                index = (self.index[0][key], self.index[1][key])
            lent = Lent(self.base, index, self.owner, guard=False)  # the same buffer: the call's guard
            lent.version, lent.probe_at, lent.probe = self.version, self.probe_at, self.probe
            return lent
        return self.rows()[0][key].copy()

    def rows(self) -> tuple[np.ndarray, bool]:
        """The rows as ``(N, L, k)`` int16 and whether that is still the caller's memory (a view)."""
        arr = self.base[self.index]  # a slice: a view; (b, t): a gather, a new buffer
        view = np.may_share_memory(arr, self.base)
        if arr.dtype != np.int16:
            arr, view = arr.astype(np.int16), False
        return arr, view

    def changed(self) -> str | None:
        """What changed in the caller's buffer since the call (None: nothing the guard sees)."""
        if self.version is not None and getattr(self.owner, "_version", self.version) != self.version:
            return f"the tensor was written in place (version {self.version} -> {self.owner._version})"
        if self.probe is not None:
            now = self.base[self.probe_at]
            if not np.array_equal(now, self.probe):
                rows = int(np.count_nonzero((now != self.probe).reshape(len(now), -1).any(1)))
                return f"{rows} of {len(now)} probed rows hold other expert ids"
        return None


class Handoff:
    """A value handed to ``log_step`` for good (:func:`handoff`)."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value


def handoff(value: object) -> Handoff:
    """Wrap a ``log_step`` input the caller will not touch again (a tensor or array it built for the call):
    the logger keeps it as it is, with no copy at the call and no guard (a buffer the caller does reuse must not
    be handed off)."""
    return Handoff(value)


def default_fraction(shape: tuple[int, int, int]) -> float:
    """The share of token rows that keep their full expert lists by default: :data:`LIST_BYTES` over two sides'
    lists at the ids' entropy (``L * k * log2(experts)`` bits a side), at most 1. Measured (``docs/moe.md``): 1 at
    the toy MoE's (4, 2, 8), 0.024 at Qwen3-30B-A3B's (48, 8, 128), 0.017 at DeepSeek-V3's (58, 8, 256)."""
    layers, top_k, experts = shape
    side = layers * top_k * math.ceil(math.log2(experts)) / 8
    return min(1.0, LIST_BYTES / (2 * side))


def check_fraction(value: object, shape: tuple[int, int, int] | None) -> float | None:
    """``routing_fraction`` as a float in (0, 1] (None: :func:`default_fraction`; without a routing shape, None);
    ValueError naming the setting."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not 0.0 < float(value) <= 1.0):
        raise ValueError(f"routing_fraction must be in (0, 1] (the share of token rows that keep their full expert "
                         f"lists) or None (chosen by the routing shape), got {value!r}")
    if shape is None:
        if value is not None:
            raise ValueError("routing_fraction needs routing_shape=(MoE layers, top-k, experts)")
        return None
    return default_fraction(shape) if value is None else float(value)


@dataclass(frozen=True)
class RoutingPlan:
    """What the writer does with one call's expert lists: the run's shape, the share of rows that keep their
    lists, and the seed their sample is drawn with."""

    shape: tuple[int, int, int]
    fraction: float
    seed: int


def hits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(N, L)`` uint8: how many of ``a``'s k choices in each layer are also ``b``'s (``(N, L, k)`` each, the k ids
    of a layer distinct). Row chunks, each slot's ids laid out contiguously so the k x k comparisons run on whole
    ``(rows, L)`` arrays (measured 4x faster than bit sets of the layers' experts, ``docs/moe.md``)."""
    n, _, k = a.shape
    out = np.zeros(a.shape[:2], np.uint8)
    for lo in range(0, n, CHUNK):
        x = np.ascontiguousarray(np.moveaxis(a[lo: lo + CHUNK], 2, 0))  # (k, rows, L)
        y = np.ascontiguousarray(np.moveaxis(b[lo: lo + CHUNK], 2, 0))
        acc = out[lo: lo + CHUNK]
        for i in range(k):
            for j in range(k):
                acc += x[i] == y[j]
    return out


def first_differing(h: np.ndarray, k: int) -> np.ndarray:
    """``(N,)`` int16: the first layer whose hits ``h`` ``(N, L)`` fall short of ``k``, -1 where none does."""
    short = h < k
    return np.where(short.any(1), short.argmax(1), -1).astype(np.int16)


def derive(cols: dict[str, np.ndarray], step: int, plan: RoutingPlan) -> str | None:
    """Writer thread, over every row of a call before the ``token_fraction`` sample: fill :data:`DERIVED` from the
    lists given (agreement and first layer with the engine's and the trainer's; the replace rate with the engine's
    and the router's; faults with the engine's and the router's own pick, else the trainer's) and :data:`KEEP`.
    Rows whose engine routing is missing (all -1) get NaN agreement and replace rate (null on disk), first layer
    -2 and the ``fallback`` fault.

    Lent lists (:class:`Lent`) are read here, and only the kept rows copied; returns what changed in a guarded
    buffer by the end (then the routing columns are left out of the call), else None."""
    given = [s for s in SIDES if s in cols]
    if not given:
        return None
    lent = {s: cols[s] for s in given if isinstance(cols[s], Lent)}
    views = set()
    for s, lent_col in lent.items():
        cols[s], view = lent_col.rows()
        if view:
            views.add(s)
    layers, k, _ = plan.shape
    n = len(cols[given[0]])
    engine = cols.get("engine_experts")
    valid = np.ones(n, bool) if engine is None else engine[:, 0, 0] >= 0  # a fallback row is -1 throughout
    trainer, router = cols.get("trainer_experts"), cols.get("router_experts")
    fault = np.where(valid, 0, FAULTS["fallback"]).astype(np.int8)
    sid = cols["sample_id"]
    if engine is not None:
        found = {}
        for name, side in (("trainer", trainer), ("router", router)):
            if side is not None:
                found[name] = h = hits(engine, side)  # (N, L); a fallback row's -1 shares nothing
                share = np.where(valid, h.sum(1) / (layers * k), np.nan)  # (N,)
                if name == "trainer":
                    if "routing_agreement" not in cols:
                        cols["routing_agreement"] = share.astype(np.float32)
                    cols["routing_first_layer"] = np.where(valid, first_differing(h, k), -2).astype(np.int16)
                    cols["_routing_layer_agreement"] = h  # (N, L): the summaries' per-layer rows
                else:
                    cols["routing_replaced"] = (1.0 - share).astype(np.float32)
                    cols["_routing_layer_replaced"] = h
        own = "router" if router is not None else "trainer" if trainer is not None else None
        if own is not None:
            fault |= _shifted(engine, router if router is not None else trainer, found[own], valid, sid,
                              cols["pos"])
        fault |= _reused(engine, valid, sid, cols["token_id"], layers * math.log2(math.comb(plan.shape[2], k)))
    cols["routing_fault"] = fault
    keep = keep_hash(plan.seed + 0x5EED, step, sid) < plan.fraction if plan.fraction < 1.0 else np.ones(n, bool)
    cols[KEEP] = keep = keep | (fault != 0)
    for s in views:  # the last read of the caller's memory: the rows whose lists are written, copied
        cols[s] = _kept_rows(cols[s], keep)
    changed = {s: why for s, lent_col in lent.items() if (why := lent_col.changed())}
    if changed:
        for name in (*SIDES, *DERIVED, KEEP, "_routing_layer_agreement", "_routing_layer_replaced"):
            cols.pop(name, None)
        return "; ".join(f"{s}: {why}" for s, why in changed.items())
    return None


def _kept_rows(arr: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``arr`` ``(N, L, k)`` with the ``keep`` rows copied and the others 0 (never read: their lists are null), in
    zeroed memory the untouched rows of which cost no pages."""
    if keep.all():
        return arr.copy()
    out = np.zeros(arr.shape, arr.dtype)
    out[keep] = arr[keep]
    return out


def _shifted(engine: np.ndarray, own: np.ndarray, aligned: np.ndarray, valid: np.ndarray, sid: np.ndarray,
             pos: np.ndarray) -> np.ndarray:
    """``(N,)`` int8: the ``shifted`` bit on every row of a response whose engine experts agree with the router's own
    pick ``own`` one position later or earlier more than at their own position (``aligned`` ``(N, L)``, the hits
    there), and on at least :data:`SHIFT_MIN` of the choices, over its first :data:`SHIFT_POSITIONS` valid
    neighbouring rows (a buffer shifted by one is shifted throughout)."""
    n = len(sid)
    out = np.zeros(n, np.int8)
    pair = np.flatnonzero((sid[1:] == sid[:-1]) & (pos[1:] == pos[:-1] + 1) & valid[1:] & valid[:-1]
                          & (pos[:-1] < SHIFT_POSITIONS))  # (P,) rows r whose row r + 1 is the next position
    if not len(pair):
        return out
    _, sample = np.unique(sid, return_inverse=True)  # (N,) the response of each row
    s = sample[pair]
    nb = int(sample.max()) + 1
    width = engine.shape[1] * engine.shape[2]
    count = np.bincount(s, minlength=nb) * width  # (nb,) choices compared
    at_own = np.bincount(s, aligned[pair].sum(1), minlength=nb)
    later = np.bincount(s, hits(engine[pair], own[pair + 1]).sum(1), minlength=nb)  # engine r, router r + 1
    earlier = np.bincount(s, hits(engine[pair + 1], own[pair]).sum(1), minlength=nb)
    best = np.maximum(later, earlier)
    bad = (count > 0) & (best > at_own) & (best >= SHIFT_MIN * np.maximum(count, 1))  # (nb,)
    out[bad[sample]] = FAULTS["shifted"]
    return out


def _reused(engine: np.ndarray, valid: np.ndarray, sid: np.ndarray, token_id: np.ndarray,
            bits_per_row: float = math.inf) -> np.ndarray:
    """``(N,)`` int8: the ``reused`` bit on every row of a response whose engine experts (every valid row) equal
    another response's while their tokens before the last differ (routing at a position depends on the tokens up to
    it, so equal prefixes route alike and are not flagged). Only responses whose routing holds
    :data:`REUSED_MIN_BITS` (``bits_per_row`` a valid row) are compared: shorter ones can match by chance."""
    out = np.zeros(len(sid), np.int8)
    bounds = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1], True])  # responses are contiguous runs of rows
    seen: dict[bytes, list[tuple[bytes, int, int]]] = {}
    for lo, hi in itertools.pairwise(bounds):
        rows = engine[lo:hi][valid[lo:hi]]
        if not len(rows) or len(rows) * bits_per_row < REUSED_MIN_BITS:
            continue
        key = hashlib.blake2b(np.ascontiguousarray(rows).tobytes(), digest_size=16).digest()
        prefix = hashlib.blake2b(np.ascontiguousarray(token_id[lo: hi - 1]).tobytes(), digest_size=16).digest()
        seen.setdefault(key, []).append((prefix, lo, hi))
    for group in seen.values():
        if len({p for p, _, _ in group}) > 1:
            for _, lo, hi in group:
                out[lo:hi] = FAULTS["reused"]
    return out
