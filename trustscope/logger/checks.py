"""Input checking and flattening: what log_step is handed becomes checked, flat numpy token rows (a :class:`_Batch`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trustscope import schema as S
from trustscope.schema import SchemaError

TOKEN_INPUTS = tuple(n for n in S.TOKENS.names if n not in ("run_id", "step", "rank", "pos", "loss_rule"))
SAMPLE_INPUTS = tuple(n for n in S.SAMPLES.names if n not in ("run_id", "step", "rank"))
PER_SEQUENCE = ("sample_id", "prompt_id")  # always (B,)
MAYBE_PER_SEQUENCE = ("advantage",)  # (B,) broadcast over T, or (B, T)
FLOAT_TOKEN_COLUMNS = ("mu_logprob", "old_logprob", "pi_logprob", "advantage", "entropy", "topk_tv", "topk_kl")


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


def _n_samples(samples: Mapping[str, Any] | None) -> int:
    if not samples:
        return 0
    name, value = next(iter(samples.items()))
    try:
        return len(value)
    except TypeError:
        raise _Rejected(f"samples[{name!r}] must be a sequence with one value per sample, got {value!r}") from None
