"""Input checking and flattening: what ``log_step`` is handed becomes a checked :class:`.Batch` of flat numpy rows.

Everything that could fail later on the writer thread is refused here, at the call, naming the field and the
value: integers that do not fit their column, text that is not valid UTF-8, a step or scalar logged twice.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from trustscope import columns as C
from trustscope import runformat as S
from trustscope.logger.batch import Batch
from trustscope.logger.experts import Handoff, Lent, RoutingPlan, check_fraction
from trustscope.logger.sampling import keep_hash
from trustscope.runformat.errors import LogWarning, SchemaError

TOKEN_INPUTS = tuple(c.name for c in C.TOKEN_COLUMNS if c.given != "logger")
TEXT_IDS = {"prompt_token_ids": "prompt", "response_token_ids": "response"}
"""Sample inputs the writer thread decodes into a text column with the logger's vocab (``text_fraction``)."""
SAMPLE_INPUTS = tuple(c.name for c in C.SAMPLE_COLUMNS if c.given != "logger") + tuple(TEXT_IDS)
PER_SEQUENCE = tuple(c.name for c in C.TOKEN_COLUMNS if c.given == "sequence")  # always (B,)
ROUTING = tuple(c.name for c in C.TOKEN_COLUMNS if c.given == "routing")  # (B, T, L, k)
MAYBE_PER_SEQUENCE = tuple(c.name for c in C.TOKEN_COLUMNS if c.given == "token_or_sequence")  # (B,) or (B, T)
MAX_STEP = 2**63 - 1  # steps are int64
DEFAULT_ID_STRIDE = 2**32
"""Default sample ids of rank r are ``r * DEFAULT_ID_STRIDE + i``, so ranks that pass none never collide."""


def _is_tensor(x: Any) -> bool:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # torch may be importing in the writer thread
    return tensor is not None and isinstance(x, tensor)


def _narrow_float(x: Any) -> bool:
    """A tensor of floats narrower than float32 (bf16, fp16), which :func:`_to_numpy` widens (a new buffer)."""
    return x.is_floating_point() and x.dtype.itemsize < 4


def _to_numpy(x: Any, name: str, text: bool = False) -> np.ndarray:
    """A numpy view or copy of a tensor, array, scalar or (nested, rectangular) list; ``text``: strings (and
    None) kept as an object array."""
    if text:
        if isinstance(x, np.ndarray) and x.dtype.kind in "OUS":
            return x.astype(object)
        if isinstance(x, (list, tuple)):
            arr = np.empty(len(x), dtype=object)
            for i, v in enumerate(x):
                arr[i] = v if v is None or isinstance(v, str) else _to_numpy(v, f"{name}[{i}]", text=True)
            if len(x) and all(isinstance(v, np.ndarray) for v in arr):
                try:
                    return np.stack(list(arr))
                except ValueError:
                    raise SchemaError(f"{name}: rows of several lengths cannot form a (B, T) array") from None
            return arr
    if _is_tensor(x):
        x = x.detach()
        if _narrow_float(x):
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


def _fresh(x: Any) -> bool:
    """Whether :func:`_to_numpy` of ``x`` is a new buffer nobody else holds: a tensor copied off its device or
    converted from a narrower float. Anything else may be the caller's memory, which it may reuse once
    ``log_step`` returns, so it is copied."""
    return _is_tensor(x) and (x.device.type != "cpu" or _narrow_float(x))


def _is_ragged(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and not np.isscalar(x[0]) and x[0] is not None


def _as_float(arr: np.ndarray, name: str, dtype: type = np.float32) -> np.ndarray:
    if arr.dtype.kind not in "fiub":
        raise SchemaError(f"{name}: expected numbers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def _as_int(arr: np.ndarray, name: str, dtype: type = np.int64) -> np.ndarray:
    """``arr`` as integers of ``dtype``; refuses non-integers and values that do not fit (no silent wrap-around)."""
    info = np.iinfo(dtype)
    if arr.dtype.kind == "f":
        ok = np.isfinite(arr) & (arr == np.round(arr))
        if arr.size and not ok.all():
            raise SchemaError(f"{name}: expected integers, got {arr[~ok][0]}")
        fits = (arr >= float(info.min)) & (arr < -float(info.min))  # -min is 2**(bits-1), exact in float64
    elif arr.dtype.kind in "iu":
        fits = None if not arr.size or (arr.min() >= info.min and arr.max() <= info.max) else \
            (arr >= info.min) & (arr <= info.max)
    elif arr.dtype.kind == "b":
        fits = None
    else:
        raise SchemaError(f"{name}: expected integers, got dtype {arr.dtype}")
    if fits is not None and not fits.all():
        raise SchemaError(f"{name}: {arr[~fits][0]} does not fit the column's {np.dtype(dtype).name} "
                          f"(must be in [{info.min}, {info.max}])")
    return arr.astype(dtype, copy=False)


def check_text(values: list[Any], name: str, where: str = "row", ids: Any = None) -> None:
    """Refuse a string that cannot be stored as UTF-8 (a lone surrogate), naming the field, where, and the text."""
    for i, value in enumerate(values):
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                at = f"{where} {i if ids is None else ids[i]}"
                raise Rejected(f"{name} at {at} is not valid UTF-8 text ({err.reason} at character {err.start}: "
                               f"{value[max(0, err.start - 10): err.start + 10]!r})") from None


def _within(arr: np.ndarray, low: float, high: float, finite: bool = False) -> bool:
    """Fast check by two reductions (no temporaries): every value in [low, high] (and finite) and none NaN."""
    if arr.size == 0:
        return True
    lo, hi = arr.min(), arr.max()  # NaN propagates into both
    if finite and (np.isinf(lo) or np.isinf(hi)):
        return False
    return bool(lo >= low) and bool(hi <= high)


class Rejected(Exception):
    """A problem that drops the whole call (strict=False) or raises SchemaError (strict)."""


class _RowChecker:
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
        first = first.item() if isinstance(first, np.generic) else first
        msg = f"{name} {what}, got {first!r} at {self.where(idx[0])} ({len(idx)} bad row(s))"
        if self.strict:
            raise SchemaError(msg)
        self.bad[idx] = True
        self.messages.append(msg)


def _flatten_tokens(
    tokens: Mapping[str, Any], mask: Any, either: tuple[str, ...] = MAYBE_PER_SEQUENCE,
    text: frozenset[str] = frozenset(), lists: frozenset[str] = frozenset(S.TOPK_COLUMNS), lend: bool = False,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Token columns as flat rows. Returns (columns, row -> sequence index b, row -> pos, lengths (B,)).

    Per-token columns become ``(N,)``, list columns (``lists``: top-K, a list per token) ``(N, K)``, per-sequence
    columns (and the ``either`` columns given ``(B,)``) are broadcast. ``text``: the string columns (kept as object
    arrays). ``lend``: padded routed-expert lists are not copied but lent (:class:`~trustscope.logger.experts.Lent`,
    read on the writer thread). A value wrapped in :func:`~trustscope.logger.experts.handoff` is the logger's: kept
    without a copy.
    """
    given = {name for name, value in tokens.items() if isinstance(value, Handoff)}
    tokens = {name: value.value if name in given else value for name, value in tokens.items()}
    if "token_id" not in tokens:
        raise Rejected("tokens['token_id'] is required")
    if isinstance(tokens["token_id"], (list, tuple)) and (mask is None or isinstance(mask, (list, tuple))):
        return _flatten_ragged(tokens, either, text, lists, mask)
    token_id = _to_numpy(tokens["token_id"], "tokens['token_id']")
    if token_id.ndim != 2:
        raise Rejected(f"tokens['token_id'] must be (B, T) with a mask, or ragged with mask=None; "
                        f"got shape {token_id.shape}")
    B, T = token_id.shape
    if mask is None:
        m = np.ones((B, T), dtype=bool)
    else:
        m = _to_numpy(mask, "mask")
        if m.shape != (B, T):
            raise Rejected(f"mask has shape {m.shape}, tokens['token_id'] has {(B, T)}: they must agree")
        if m.dtype != np.bool_:
            if not np.isin(m, (0, 1)).all():
                raise Rejected(f"mask must be boolean (or 0/1), got value {m[~np.isin(m, (0, 1))][0]}")
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
        arr = _to_numpy(value, f"tokens[{name!r}]", name in text)
        label = f"tokens[{name!r}]"
        owned = name in given or _fresh(value)
        if name in lists:
            if arr.ndim != 3 or arr.shape[:2] != (B, T):
                raise Rejected(f"{label} must have shape (B, T, K) = ({B}, {T}, K), got {arr.shape}")
            flat = arr.reshape(B * T, -1)
            cols[name] = (flat if owned else flat.copy()) if full else arr[b, t]
        elif name in ROUTING:
            if arr.ndim != 4 or arr.shape[:2] != (B, T):
                raise Rejected(f"{label} must have shape (B, T, L, k) = ({B}, {T}, MoE layers, top-k), got {arr.shape}")
            if lend or owned:  # read on the writer thread: no copy here, the mask's gather there
                if full:
                    flat = arr.reshape(B * T, *arr.shape[2:])  # (N, L, k), a view unless arr is not contiguous
                    owned = owned or not np.may_share_memory(flat, arr)
                    cols[name] = Lent(flat, slice(0, B * T), value, guard=not owned)
                else:
                    cols[name] = Lent(arr, (b, t), value, guard=not owned)
                continue
            flat = arr.reshape(B * T, *arr.shape[2:])  # (N, L, k)
            cols[name] = (flat if owned else flat.copy()) if full else arr[b, t]
        elif name in PER_SEQUENCE or (name in either and arr.ndim == 1):
            if arr.shape != (B,):
                raise Rejected(f"{label} must have shape (B,) = ({B},), got {arr.shape}")
            cols[name] = arr[b]
        else:
            if arr.shape != (B, T):
                raise Rejected(f"{label} must have shape (B, T) = ({B}, {T}), got {arr.shape}")
            cols[name] = (arr.reshape(-1) if owned else arr.reshape(-1).copy()) if full else arr[b, t]
    return cols, b, t, m.sum(axis=1)


def _flatten_ragged(tokens: Mapping[str, Any], either: tuple[str, ...] = MAYBE_PER_SEQUENCE,
                    text: frozenset[str] = frozenset(), lists: frozenset[str] = frozenset(S.TOPK_COLUMNS),
                    mask: list | tuple | None = None
                    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The ragged form; ``mask``, when given, one 1-D bool sequence per response of its length: only those
    positions become rows, ``pos`` keeping the index (like the padded form's mask)."""
    seqs = tokens["token_id"]
    B = len(seqs)
    firsts = [_to_numpy(s, f"tokens['token_id'][{i}]") for i, s in enumerate(seqs)]
    for i, arr in enumerate(firsts):
        if arr.ndim != 1:
            raise Rejected(f"tokens['token_id'][{i}] must be a 1-D sequence of ids, got shape {arr.shape}")
    lengths = np.array([len(arr) for arr in firsts], dtype=np.int64)
    b = np.repeat(np.arange(B), lengths)
    t = (np.arange(len(b)) - np.repeat(np.cumsum(lengths) - lengths, lengths)).astype(np.int32)
    keep = None if mask is None else _ragged_mask(mask, lengths)
    if keep is not None:
        b, t = b[keep], t[keep]
    cols: dict[str, np.ndarray] = {}
    for name, value in tokens.items():
        label = f"tokens[{name!r}]"
        if name in PER_SEQUENCE or (name in either and not _is_ragged(value)):
            arr = _to_numpy(value, label, name in text)
            if arr.shape != (B,):
                raise Rejected(f"{label} must have one value per sample, shape ({B},), got {arr.shape}")
            cols[name] = arr[b]
            continue
        if not isinstance(value, (list, tuple)) or len(value) != B:
            raise Rejected(f"{label} must be a list of {B} per-sample sequences (like tokens['token_id']), "
                            f"got {type(value).__name__} of length {len(value) if hasattr(value, '__len__') else '?'}")
        parts = [_to_numpy(v, f"{label}[{i}]", name in text) for i, v in enumerate(value)]
        for i, part in enumerate(parts):
            ndim_ok = (part.ndim == 2 or lengths[i] == 0 if name in lists else part.ndim == 3
                       if name in ROUTING else part.ndim == 1)
            if part.ndim == 0 or len(part) != lengths[i] or not ndim_ok:
                want = (f"({lengths[i]}, K)" if name in lists else f"({lengths[i]}, L, k)" if name in ROUTING
                        else f"({lengths[i]},)")
                raise Rejected(f"{label}[{i}] has shape {part.shape}, but tokens['token_id'][{i}] has length "
                                f"{lengths[i]}: expected {want}")
        if name in lists:
            ks = {p.shape[1] for p in parts if p.ndim == 2}
            if len(ks) > 1:
                raise Rejected(f"{label}: top-K lists of several lengths {sorted(ks)} in one call")
            k = ks.pop() if ks else 0
            parts = [p.reshape(-1, k) for p in parts]
        cols[name] = np.concatenate(parts) if parts else np.zeros(0)
        if keep is not None:
            cols[name] = cols[name][keep]
    return cols, b, t, lengths if keep is None else np.bincount(b, minlength=B)


def _ragged_mask(mask: list | tuple, lengths: np.ndarray) -> np.ndarray | None:
    """The ragged form's mask as one flat bool array over every position (None: all True)."""
    if len(mask) != len(lengths):
        raise Rejected(f"mask has {len(mask)} sequence(s), tokens['token_id'] has {len(lengths)}: they must agree")
    parts = []
    for i, m in enumerate(mask):
        arr = _to_numpy(m, f"mask[{i}]")
        if arr.shape != (lengths[i],):
            raise Rejected(f"mask[{i}] has shape {arr.shape}, but tokens['token_id'][{i}] has length {lengths[i]}")
        if arr.dtype != np.bool_:
            if not np.isin(arr, (0, 1)).all():
                raise Rejected(f"mask must be boolean (or 0/1), got value {arr[~np.isin(arr, (0, 1))][0]}")
            arr = arr.astype(bool)
        parts.append(arr)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
    return None if flat.all() else flat


def _n_samples(samples: Mapping[str, Any] | None) -> int:
    if not samples:
        return 0
    name, value = next(iter(samples.items()))
    try:
        return len(value)
    except TypeError:
        raise Rejected(f"samples[{name!r}] must be a sequence with one value per sample, got {value!r}") from None


def _update_keys(tokens: Mapping[str, Any] | None, n_seq: int) -> list[int]:
    """Per sequence, the ``update_index`` its rows give (the first row's; -1 without one): with the sample id, what
    may not repeat within a step (``update_index`` itself is checked with the other token columns)."""
    value = None if not tokens else tokens.get("update_index")
    if value is None:
        return [-1] * n_seq
    try:
        arr = _to_numpy(value, "tokens['update_index']")
    except (Rejected, SchemaError, TypeError, ValueError):  # ragged or bad: the column's own check names it
        return [-1] * n_seq
    arr = arr.reshape(n_seq, -1)[:, 0] if arr.size and arr.size % max(n_seq, 1) == 0 else np.full(n_seq, -1)
    return [int(v) if np.isfinite(v) else -1 for v in arr.astype(np.float64)]


class InputChecker:
    """Checks and flattens ``log_step``'s arguments into a :class:`Batch`, keeping what it must remember across
    calls: the last step, the sample ids and scalar names already logged at it, and the run's top-K K."""

    def __init__(self, *, run_id: str, rank: int, strict: bool, loss_rule: str, token_fraction: float, seed: int,
                 vocab_size: int | None, topk_k: int | None, disk_last_step: int | None, summaries: bool = True,
                 extra_columns: tuple[C.Column, ...] = (), routing_shape: tuple[int, int, int] | None = None,
                 routing_fraction: float | None = None):
        self.run_id, self.rank, self.strict, self.loss_rule = run_id, rank, strict, loss_rule
        self.columns = (*C.TOKEN_COLUMNS, *extra_columns)
        """Every tokens column, the run's own (``extra_columns``) last: what a call may give and how it is checked."""
        self.extra = {c.name for c in extra_columns}
        self.token_inputs = (*TOKEN_INPUTS, *(c.name for c in extra_columns))
        self._either = tuple(c.name for c in self.columns if c.given == "token_or_sequence")
        self._text = frozenset(c.name for c in extra_columns if pa.types.is_string(c.type))
        self._lists = frozenset(c.name for c in self.columns if c.given in ("topk", "token_list"))
        self.token_fraction, self.seed, self.summaries = token_fraction, seed, summaries
        self.vocab_size = vocab_size
        self._k = topk_k
        self.routing_shape = routing_shape
        """``(MoE layers, top-k, experts)`` of the model, or None for a dense one: routed experts are refused."""
        self.routing_plan = None if routing_shape is None else RoutingPlan(
            routing_shape, check_fraction(routing_fraction, routing_shape), seed)
        """What the writer thread does with the calls' expert lists (:mod:`trustscope.logger.experts`)."""
        self.lend_routing = True
        """Padded routed-expert lists are lent to the writer thread, not copied at the call
        (:class:`~trustscope.logger.experts.Lent`); False (``TokenLogger(copy_routing=True)``, or once a lent buffer
        was seen changed): copied."""
        self._disk_last_step = disk_last_step
        self._last_step: int | None = None  # last step accepted by log_step in this process
        self._step_sample_ids: set[int] = set()
        self._step_scalars: set[str] = set()
        self._next_default_id = 0  # default sample ids count on over the micro-batches of a step
        self._step_calls = 0  # calls accepted at the last step

    def prepare(self, step: Any, tokens: Mapping[str, Any] | None, mask: Any, samples: Mapping[str, Any] | None,
                scalars: Mapping[str, Any] | None, loss_rule: str | None) -> Batch:
        """The checked batch of one call; raises :class:`Rejected` or :class:`SchemaError` (strict) on bad input."""
        step = self._check_step(step)
        new_step = step != self._last_step
        loss_rule = self.loss_rule if loss_rule is None else loss_rule
        if not isinstance(loss_rule, str) or not loss_rule:
            raise Rejected(f"loss_rule must be a non-empty string, got {loss_rule!r}")
        check_text([loss_rule], "loss_rule")
        for what, given, allowed in (("tokens", tokens, self.token_inputs), ("samples", samples, SAMPLE_INPUTS)):
            unknown = sorted(set(given or {}) - set(allowed))
            if unknown:
                hint = (" (a run's own per-token columns are declared once: TokenLogger(..., extra_columns={name: "
                        "type}))") if what == "tokens" else ""
                raise Rejected(f"unknown column(s) {unknown} in {what}; allowed: {list(allowed)}{hint}")
        if mask is not None and tokens is None:
            raise Rejected("mask given without tokens")
        batch = Batch(step=step, loss_rule=loss_rule, tokens=None, samples=None,
                      scalars=self._check_scalars(step, new_step, scalars), part=0 if new_step else self._step_calls)
        new_ids: list[int] = []
        defaults = 0
        if tokens or samples:
            lengths = None
            if tokens:
                cols, b, t, lengths = _flatten_tokens(tokens, mask, self._either, self._text, self._lists,
                                                      lend=self.lend_routing)
                batch.n_generated = len(b)
            n_seq = len(lengths) if lengths is not None else _n_samples(samples)
            sample_ids, defaults = self._sequence_ids(step, new_step, tokens, samples, n_seq)
            if samples:
                batch.samples = self._check_samples(samples, n_seq, lengths, sample_ids)
            if tokens:
                batch.tokens, batch.dropped_rows, batch.sampled = self._check_tokens(step, cols, b, t, sample_ids,
                                                                                     samples)
                batch.summarize = self.summaries
                if any(name in batch.tokens for name in ROUTING):
                    batch.routing = self.routing_plan
            new_ids = list(zip(sample_ids["sample_id"].tolist(), _update_keys(tokens, n_seq), strict=True))
        if new_step:  # accepted: remember what this step holds
            self._step_sample_ids, self._step_scalars, self._next_default_id, self._step_calls = set(), set(), 0, 0
        self._step_calls += 1
        self._step_sample_ids.update(new_ids)
        self._step_scalars.update(name for name, _ in batch.scalars)
        self._next_default_id += defaults
        self._last_step = step
        return batch

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise Rejected(f"step must be an int, got {step!r} ({type(step).__name__})")
        step = int(step)
        if not 0 <= step <= MAX_STEP:
            raise Rejected(f"step must be in [0, 2**63 - 1] (int64), got {step}")
        if self._last_step is not None and step < self._last_step:
            raise Rejected(f"step {step} goes backwards: step {self._last_step} was already logged")
        if self._last_step is None and self._disk_last_step is not None and step <= self._disk_last_step:
            raise Rejected(f"step {step} is not after step {self._disk_last_step}, the last step of rank "
                            f"{self.rank} already on disk in resumed run {self.run_id!r}")
        return step

    def _check_scalars(self, step: int, new_step: bool, scalars: Mapping[str, Any] | None) -> list[tuple[str, float]]:
        """``(name, value)`` pairs; a name already logged at this step (an earlier micro-batch) is refused: the
        ``steps`` table holds one value per (step, rank, name)."""
        out = []
        for name, value in (scalars or {}).items():
            if not isinstance(name, str) or not name:
                raise Rejected(f"scalar names must be non-empty strings, got {name!r}")
            check_text([name], "scalar name")
            if not new_step and name in self._step_scalars:
                raise Rejected(f"scalars[{name!r}] was already logged at step {step} by rank {self.rank}: log each "
                               f"scalar once per step (e.g. with the step's last micro-batch), or under another name")
            try:
                out.append((name, float(value)))
            except (TypeError, ValueError, OverflowError):
                raise Rejected(f"scalars[{name!r}] must be a number, got {value!r}") from None
        return out

    def _sequence_ids(self, step: int, new_step: bool, tokens: Mapping[str, Any] | None,
                      samples: Mapping[str, Any] | None, n_seq: int) -> tuple[dict[str, np.ndarray], int]:
        """Per-sequence sample_id and prompt_id ``(B,)``, from tokens or samples; checked to agree and be unique.

        Returns them and how many default sample ids were used: without a given sample_id, rank r's sequences
        get ``r * DEFAULT_ID_STRIDE + i``, ``i`` counting on over the micro-batches of the step.
        """
        defaults = 0
        ids: dict[str, np.ndarray] = {}
        for name in PER_SEQUENCE:
            found = []
            for what, given in (("tokens", tokens), ("samples", samples)):
                if given and name in given:
                    arr = _as_int(_to_numpy(given[name], f"{what}[{name!r}]"), f"{what}[{name!r}]").reshape(-1)
                    if arr.shape != (n_seq,):
                        raise Rejected(f"{what}[{name!r}] must have one value per sample ({n_seq}), "
                                        f"got shape {arr.shape}")
                    found.append((what, arr))
            if len(found) == 2 and not np.array_equal(found[0][1], found[1][1]):
                i = int(np.flatnonzero(found[0][1] != found[1][1])[0])
                raise Rejected(f"tokens[{name!r}] and samples[{name!r}] disagree at sample row {i}: "
                                f"{found[0][1][i]} vs {found[1][1][i]}")
            if found:
                ids[name] = found[0][1]
            elif name == "sample_id":
                first = self.rank * DEFAULT_ID_STRIDE + (0 if new_step else self._next_default_id)
                ids[name] = np.arange(first, first + n_seq, dtype=np.int64)
                defaults = n_seq
            else:
                raise Rejected("prompt_id is required: pass tokens['prompt_id'] or samples['prompt_id'] (B,)")
        sid = ids["sample_id"]
        if (sid < 0).any():
            raise Rejected(f"sample_id must be >= 0, got {sid[sid < 0][0]}")
        uniq, counts = np.unique(sid, return_counts=True)
        if (counts > 1).any():
            raise Rejected(f"sample_id {uniq[counts > 1][0]} appears twice in one call; sample_id must be unique "
                            f"within a step")
        if not new_step:  # a response trained by several updates of a step is logged once per update_index
            keys = zip(sid.tolist(), _update_keys(tokens, n_seq), strict=True)
            again = self._step_sample_ids.intersection(keys)
            if again:
                sample, update = min(again)
                where = "" if update < 0 else f" by update_index {update}"
                raise Rejected(f"sample_id {sample} was already logged at step {self._last_step}{where}")
        return ids, defaults

    def _check_samples(self, samples: Mapping[str, Any], n_seq: int, lengths: np.ndarray | None,
                       ids: dict[str, np.ndarray]) -> dict[str, Any]:
        out: dict[str, Any] = dict(ids)
        for name in ("prompt", "response", "finish_reason"):
            if name in samples:
                values = list(samples[name])
                if len(values) != n_seq:
                    raise Rejected(f"samples[{name!r}] has {len(values)} value(s), expected one per sample ({n_seq})")
                bad = [v for v in values if v is not None and not isinstance(v, str)]
                if bad:
                    raise Rejected(f"samples[{name!r}] must hold strings, got {bad[0]!r}")
                check_text(values, f"samples[{name!r}]", "sample_id", ids["sample_id"])
                out[name] = values
        for name, text in TEXT_IDS.items():
            if name in samples:
                out[name] = self._check_text_ids(samples, name, text, n_seq)
        for name in ("reward", "advantage"):
            if name in samples:
                label = f"samples[{name!r}]"
                arr = _as_float(_to_numpy(samples[name], label), label).reshape(-1)
                if arr.shape != (n_seq,):
                    raise Rejected(f"{label} must have one value per sample ({n_seq}), got shape {arr.shape}")
                if not np.isfinite(arr).all():
                    i = int(np.flatnonzero(~np.isfinite(arr))[0])
                    raise Rejected(f"{label} must be finite, got {arr[i]} at sample_id {ids['sample_id'][i]}")
                out[name] = arr.copy()
        if "length" in samples:
            label = "samples['length']"
            length = _as_int(_to_numpy(samples["length"], label), label, np.int32).reshape(-1)
            if length.shape != (n_seq,):
                raise Rejected(f"{label} must have one value per sample ({n_seq}), got shape {length.shape}")
            if lengths is not None and (length != lengths).any():
                i = int(np.flatnonzero(length != lengths)[0])
                raise Rejected(f"{label} is {length[i]} at sample_id {ids['sample_id'][i]}, but the mask (or the "
                                f"ragged token_id) gives length {lengths[i]}")
            if (length < 0).any():
                raise Rejected(f"{label} must be >= 0, got {length[length < 0][0]}")
            out["length"] = length.astype(np.int32)
        elif lengths is not None:
            out["length"] = lengths.astype(np.int32)
        else:
            raise Rejected("samples['length'] is required when no tokens are logged with the samples")
        return out

    def _check_text_ids(self, samples: Mapping[str, Any], name: str, text: str, n_seq: int) -> list[np.ndarray]:
        """``samples[name]``: one sequence of token ids per sample (a list of 1-D arrays, tensors or lists), as
        int64 arrays for the writer thread to decode into ``text``."""
        label = f"samples[{name!r}]"
        if text in samples:
            raise Rejected(f"{label} and samples[{text!r}] are both given; pass the text or its token ids")
        if self.vocab_size is None:
            raise Rejected(f"{label} needs the logger's vocab (TokenLogger(vocab=...)) to decode it")
        rows = list(samples[name])
        if len(rows) != n_seq:
            raise Rejected(f"{label} has {len(rows)} row(s), expected one per sample ({n_seq})")
        out = [_as_int(_to_numpy(row, label), label, np.int64).reshape(-1) for row in rows]
        flat = np.concatenate(out) if out else np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = flat[(flat < 0) | (flat >= self.vocab_size)][0]
            raise Rejected(f"{label} holds token id {bad}, outside the vocab [0, {self.vocab_size})")
        return out

    def _check_tokens(self, step: int, cols: dict[str, np.ndarray], b: np.ndarray, t: np.ndarray,
                      ids: dict[str, np.ndarray], samples: Mapping[str, Any] | None
                      ) -> tuple[dict[str, np.ndarray], int, np.ndarray | None]:
        """Check flat token rows; returns the columns of the good rows (bad rows dropped when not strict), how many
        rows were dropped, and which rows ``token_fraction`` keeps when the writer must first summarize them all
        (None: all of the returned rows are written)."""
        for name in ("mu_logprob", "pi_logprob"):
            if name not in cols:
                raise Rejected(f"tokens[{name!r}] is required")
        if "advantage" not in cols:
            if samples is None or "advantage" not in samples:
                raise Rejected("advantage is required: pass tokens['advantage'] ((B, T) or (B,)) or "
                                "samples['advantage'] (B,)")
            label = "samples['advantage']"
            cols["advantage"] = _as_float(_to_numpy(samples["advantage"], label), label).reshape(-1)[b]
        cols["sample_id"] = ids["sample_id"][b]
        cols["prompt_id"] = ids["prompt_id"][b]
        cols["pos"] = t
        sid = cols["sample_id"]
        check = _RowChecker(self.strict, len(b), lambda i: f"sample_id {sid[i]}, pos {t[i]}")

        self._check_topk(cols)
        self._check_routing(cols)
        for col in self.columns:  # each given column gets its declared check (trustscope.columns)
            if col.check is not None and col.name in cols:
                CHECKERS[col.check.kind](self, cols, col, check, step)

        keep = ~check.bad
        dropped = int(check.bad.sum())
        if check.messages:
            warnings.warn(f"trustscope: dropped {int(check.bad.sum())} token row(s): " + "; ".join(check.messages),
                          LogWarning, stacklevel=4)
        if dropped:
            cols = {name: arr[keep] for name, arr in cols.items()}
            sid = cols["sample_id"]
        sampled = None
        if self.token_fraction < 1.0:
            sampled = keep_hash(self.seed, step, sid) < self.token_fraction
            if sampled.all():
                sampled = None
            elif not self.summaries:
                cols = {name: arr[sampled] for name, arr in cols.items()}
                sampled = None
        return cols, dropped, sampled

    def _check_ids(self, cols: dict[str, np.ndarray], name: str, check: _RowChecker) -> None:
        """Token ids as int32 in ``[0, vocab size)``; one reduction when all are fine (the common case)."""
        label = f"tokens[{name!r}]"
        upper = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int32).max
        ids = cols[name]
        if ids.dtype.kind in "iu":  # seen as unsigned, a negative id is huge: the max alone checks both ends
            unsigned = ids.view(f"u{ids.dtype.itemsize}")
            if not ids.size or unsigned.max() < upper:  # then it fits int32 too: upper <= 2**31 - 1
                cols[name] = ids.astype(np.int32, copy=False)
                return
        ids = cols[name] = _as_int(ids, label, np.int32)
        if not _within(ids, 0, upper - 1):
            check.rows((ids >= 0) & (ids < upper), label, f"must be in [0, {upper})", ids)

    def _check_routing(self, cols: dict[str, np.ndarray]) -> None:
        """Routed experts against the run's ``routing_shape``, refused whole naming the field, the row (sample_id,
        pos) and the shapes: ``(N, L, k)`` integer ids in ``[0, experts)``; an ``engine_experts`` row of -1
        throughout is a token the engine reported no routing for (a fallback, counted by the writer). The
        per-token figures and the share of rows that keep their lists are the writer thread's
        (:func:`trustscope.logger.experts.derive`): here one pass over the ids at most."""
        given = [name for name in ROUTING if name in cols]
        if not given:
            return
        if self.routing_shape is None:
            raise Rejected(f"tokens[{given[0]!r}]: routing given for a dense model; declare the model's "
                           f"TokenLogger(routing_shape=(MoE layers, top-k, experts)) to log routed experts")
        layers, top_k, experts = self.routing_shape
        for name in given:
            arr, label = cols[name], f"tokens[{name!r}]"
            if arr.ndim != 3 or arr.shape[1:] != (layers, top_k):
                raise Rejected(f"{label} has shape {arr.shape} (token rows, MoE layers, top-k), the run's "
                               f"routing_shape routes (N, {layers}, {top_k}) of {experts} experts")
            if arr.dtype.kind not in "iu":
                raise Rejected(f"{label} must hold integer expert ids, got dtype {arr.dtype}")
            if isinstance(arr, Lent):  # the whole lent buffer (padding too) in range: it stays lent
                if _ids_below(arr.base, experts):
                    continue
                rows, view = arr.rows()  # else the rows the mask keeps, read now and checked one by one
                arr = rows.copy() if view else rows
            if not _ids_below(arr, experts):
                bad = (arr < 0) | (arr >= experts)  # (N, L, k)
                if name == "engine_experts":
                    bad &= ~(arr == -1).all((1, 2))[:, None, None]  # fallback rows
                if bad.any():
                    row, layer, slot = (int(i) for i in np.argwhere(bad)[0])
                    raise Rejected(f"{label}: expert id {int(arr[row, layer, slot])} at sample_id "
                                   f"{int(cols['sample_id'][row])}, pos {int(cols['pos'][row])}, MoE layer {layer}, "
                                   f"slot {slot} is out of range [0, {experts}) (routing_shape {self.routing_shape}; "
                                   f"-1 throughout a row of engine_experts: the engine reported no routing)")
            cols[name] = arr.astype(np.int16, copy=False)

    def _check_topk(self, cols: dict[str, np.ndarray]) -> None:
        """The top-K lists' shape: both of ids and mu's log-probs, one K for all lists and for the whole run."""
        given = [name for name in S.TOPK_COLUMNS if name in cols]
        if not given:
            return
        if "mu_topk_ids" not in cols or "mu_topk_logprobs" not in cols:
            raise Rejected(f"top-K needs both tokens['mu_topk_ids'] and tokens['mu_topk_logprobs'], got {given}")
        ks = {name: cols[name].shape[1] for name in given}
        k = ks["mu_topk_ids"]
        for name, kk in ks.items():
            if kk != k:
                raise Rejected(f"tokens[{name!r}] has K = {kk}, but tokens['mu_topk_ids'] has K = {k}")
        if self._k is not None and k != self._k:
            raise Rejected(f"tokens['mu_topk_ids'] has K = {k}, but this run logs K = {self._k}")
        if k < 1:
            raise Rejected("tokens['mu_topk_ids'] has K = 0; leave the top-K columns out instead")
        self._k = k


def _ids_below(arr: np.ndarray, experts: int) -> bool:
    """Whether every id of ``arr`` is in ``[0, experts)``: one reduction (a negative id is huge unsigned)."""
    if not arr.size:
        return True
    if arr.dtype.kind == "i" and arr.dtype.itemsize <= 8:
        return bool(arr.view(f"u{arr.dtype.itemsize}").max() < experts)
    return bool(arr.max() < experts)


def _check_logprob(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                   step: int) -> None:
    name = col.name
    arr = cols[name] = _as_float(cols[name], f"tokens[{name!r}]")
    if not _within(arr, -np.inf, S.LOGPROB_TOLERANCE, finite=True):
        finite = np.isfinite(arr)
        check.rows(finite, f"tokens[{name!r}]", "must be finite", arr)
        check.rows(~finite | (arr <= S.LOGPROB_TOLERANCE), f"tokens[{name!r}]",
                   f"must be a log-probability (<= 0, tolerance {S.LOGPROB_TOLERANCE})", arr)
    if arr.size and arr.max() > 0:  # float rounding of log 1, within the tolerance: store 0
        np.minimum(arr, 0.0, out=arr)


def _check_range(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                 step: int) -> None:
    name, low, high = col.name, col.check.low, col.check.high
    if pa.types.is_float64(col.type):
        arr = cols[name] = _as_float(cols[name], f"tokens[{name!r}]", np.float64)
    else:
        arr = cols[name] = _as_float(cols[name], f"tokens[{name!r}]")
    if not _within(arr, low, high, finite=True):
        what = "must be finite" if col.check.kind == "finite" else f"must be finite and in [{low}, {high}]"
        check.rows(np.isfinite(arr) & (arr >= low) & (arr <= high), f"tokens[{name!r}]", what, arr)


def _check_token_id(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                    step: int) -> None:
    checker._check_ids(cols, col.name, check)


def _check_bool(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                step: int) -> None:
    arr = cols[col.name]
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iufb":
            raise SchemaError(f"tokens[{col.name!r}]: expected booleans, got dtype {arr.dtype}")
        check.rows(np.isin(arr, (0, 1)), f"tokens[{col.name!r}]", "must be boolean (or 0/1)", arr)
        cols[col.name] = arr.astype(bool)


def _check_int(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
               step: int) -> None:
    label = f"tokens[{col.name!r}]"
    value_type = col.type.value_type if pa.types.is_list(col.type) else col.type
    arr = cols[col.name] = _as_int(cols[col.name], label, value_type.to_pandas_dtype())
    if col.check.low > -np.inf and not _within(arr, col.check.low, np.inf):
        check.rows(arr >= col.check.low, label, f"must be >= {int(col.check.low)}", arr)


def _check_version(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                   step: int) -> None:
    """A weight version in [0, step]: the engine that sampled the token cannot be ahead of the trainer."""
    label = f"tokens[{col.name!r}]"
    arr = cols[col.name] = _as_int(cols[col.name], label, np.int64)
    if not _within(arr, 0, step):
        check.rows((arr >= 0) & (arr <= step), label,
                   f"must be a weight version in [0, {step}] (the step: the trainer's version)", arr)


def _check_turn(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                step: int) -> None:
    """A turn >= 0 that never decreases along a response (rows come in (response, pos) order)."""
    label = f"tokens[{col.name!r}]"
    arr = cols[col.name] = _as_int(cols[col.name], label, np.int32)
    if not _within(arr, 0, np.iinfo(np.int32).max):
        check.rows(arr >= 0, label, "must be >= 0", arr)
    if len(arr) > 1:
        sid = cols["sample_id"]
        down = np.zeros(len(arr), dtype=bool)
        down[1:] = (sid[1:] == sid[:-1]) & (arr[1:] < arr[:-1])  # (N,) a row whose turn is below its predecessor's
        if down.any():
            check.rows(~down, label, "must not decrease within a response (turns only go forward)", arr)


def _check_text(checker: InputChecker, cols: dict[str, np.ndarray], col: C.Column, check: _RowChecker,
                step: int) -> None:
    arr = cols[col.name]
    ok = np.fromiter((v is None or isinstance(v, str) for v in arr), dtype=bool, count=len(arr))
    check.rows(ok, f"tokens[{col.name!r}]", "must hold strings (or None)", arr)
    sid = cols["sample_id"]
    check_text(list(arr), f"tokens[{col.name!r}]", "sample_id", sid)


CHECKERS = {"logprob": _check_logprob, "range": _check_range, "finite": _check_range, "token_id": _check_token_id,
            "bool": _check_bool, "int": _check_int, "version": _check_version, "turn": _check_turn,
            "text": _check_text}
"""One function per check kind of :data:`trustscope.columns.CHECKS`: ``(checker, cols, column, rows, step)``
checks ``cols[column.name]`` in place (converted to the column's type), flagging bad rows on ``rows``."""

