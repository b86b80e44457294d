"""The public face: :class:`TokenLogger` and the no-op :class:`NullLogger`."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import secrets
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import __version__
from trustscope import schema as S
from trustscope.logger.checks import (
    PER_SEQUENCE,
    SAMPLE_INPUTS,
    TOKEN_INPUTS,
    _as_float,
    _as_int,
    _Batch,
    _Checker,
    _flatten_tokens,
    _keep_hash,
    _n_samples,
    _Rejected,
    _to_numpy,
    _within,
)
from trustscope.logger.errors import LogDirError, LogWarning
from trustscope.logger.runfiles import (
    _RUN_ID_OK,
    _jsonable,
    _last_step_on_disk,
    _now,
    _process_start,
    _rank_data_files,
    _rank_file,
    _read_json,
    _vocab_texts,
    _world_size,
    _write_json_atomic,
    resolve_rank,
)
from trustscope.logger.writer import _list_array, _Table, round_mantissa, topk_divergences
from trustscope.schema import SchemaError

MU_SOURCES = frozenset({"engine", "trainer_recompute", "imported"})


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


def _close_at_exit(logger: TokenLogger) -> Any:
    """An atexit hook that closes ``logger`` (as crashed: the program ended without close()) if still alive."""
    ref = weakref.ref(logger)

    def hook() -> None:
        lg = ref()
        if lg is not None and not lg._closed:
            with contextlib.suppress(Exception):  # nothing left to report to at exit
                lg.close(status="crashed", error="the process exited without TokenLogger.close()")

    return hook


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
