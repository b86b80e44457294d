"""The public face: :class:`TokenLogger` and the no-op :class:`NullLogger`.

The write path reads in one direction: :meth:`TokenLogger.log_step` checks and flattens the call
(:class:`~trustscope.logger.checks.InputChecker`), queues the batch for the writer thread
(:class:`~trustscope.logger.writer.Writer`), which writes Parquet and commits each flush in the rank's manifest
(:class:`~trustscope.runformat.runfiles.RunFiles`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import warnings
import weakref
from collections.abc import Callable, Container, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from trustscope import __version__
from trustscope import columns as C
from trustscope import runformat as S
from trustscope.logger.checks import InputChecker, Rejected, check_text
from trustscope.logger.memory import ON_FULL, RowBudget, default_max_buffered_rows
from trustscope.logger.summaries import blocked_rule_list, summary_rules
from trustscope.logger.writer import Writer, default_write_threads
from trustscope.runformat.background import BackgroundCompactor, background_compaction
from trustscope.runformat.compaction import FANIN
from trustscope.runformat.cutback import drop_steps_after, short_detail, short_of
from trustscope.runformat.errors import LogDirError, LogWarning, SchemaError
from trustscope.runformat.incidents import MANIFEST_KEY as INCIDENTS_KEY
from trustscope.runformat.incidents import SCALAR_PREFIX as INCIDENT_PREFIX
from trustscope.runformat.incidents import add_incident
from trustscope.runformat.incidents import counters as incident_counters
from trustscope.runformat.manifest import jsonable, store_manifests
from trustscope.runformat.retry import StorageError
from trustscope.runformat.runfiles import RUN_ID_OK, RunFiles, resolve_rank, vocab_texts
from trustscope.runformat.stores import open_store

MU_SOURCES = frozenset({"engine", "trainer_recompute", "imported"})
"""Where mu_logprob came from: the inference engine's own log-probs (the real behaviour policy), or, for
frameworks that keep none, the trainer's recompute (then mu == pi_old and no mismatch can be measured)."""


class TokenLogger:
    """Logs tokens, samples and scalars of an RL run to ``<logdir>/<run_id>/``. See :mod:`trustscope.logger`.

    ``logdir`` may be an object store prefix, ``s3://bucket/prefix``, with ``storage_options`` for
    ``s3fs.S3FileSystem`` (else the usual AWS variables): the store is checked here (reachable, bucket present,
    a test object written and deleted) and a store that fails raises :class:`LogDirError` with the URL and the
    cause. See "Logs on object storage" in ``docs/logging.md``.
    """

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
        loss_params: Mapping[str, Any] | None = None,
        rule_settings: Sequence[str] = (),
        mu_source: str = "engine",
        source: Mapping[str, Any] | None = None,
        rank: int | None = None,
        resume: bool = False,
        strict: bool = True,
        token_fraction: float = 1.0,
        text_fraction: float | None = None,
        log_topk: bool = True,
        topk_precision: str = "float32",
        flush_rows: int = 1_000_000,
        flush_seconds: float = 30.0,
        max_queue: int = 8,
        max_buffered_rows: int | None = None,
        on_full: str = "block",
        block_timeout_s: float | None = 60.0,
        seed: int = 0,
        row_group_size: int = 1 << 17,
        fsync: bool = True,
        write_threads: int | None = None,
        summaries: bool = True,
        compact_every: int = FANIN,
        storage_options: Mapping[str, Any] | None = None,
        extra_columns: Mapping[str, str] | None = None,
        max_staleness: int | None = None,
        routing_shape: tuple[int, int, int] | None = None,
        routing_replay: bool = False,
        routing_fraction: float | None = None,
        copy_routing: bool = False,
    ):
        if not 0.0 < token_fraction <= 1.0:
            raise ValueError(f"token_fraction must be in (0, 1], got {token_fraction}")
        text_fraction = float(token_fraction) if text_fraction is None else text_fraction
        if isinstance(text_fraction, bool) or not isinstance(text_fraction, int | float) \
                or not 0.0 <= text_fraction <= 1.0:
            raise ValueError(f"text_fraction must be in [0, 1] (the share of samples whose prompt and response "
                             f"texts are kept) or None (token_fraction's), got {text_fraction!r}")
        if topk_precision not in ("float32", "float16"):
            raise ValueError(f"topk_precision must be 'float32' or 'float16', got {topk_precision!r}")
        for name, value in (("flush_rows", flush_rows), ("max_queue", max_queue), ("row_group_size", row_group_size),
                            ("write_threads", 1 if write_threads is None else write_threads)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_buffered_rows is None:
            max_buffered_rows = default_max_buffered_rows(int(flush_rows))
        if isinstance(max_buffered_rows, bool) or not isinstance(max_buffered_rows, int) or max_buffered_rows < 1:
            raise ValueError(f"max_buffered_rows must be an int >= 1 (token rows waiting in memory) or None (the "
                             f"default, {default_max_buffered_rows(int(flush_rows))} here), got {max_buffered_rows!r}")
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {list(ON_FULL)}, got {on_full!r}")
        if block_timeout_s is not None and (isinstance(block_timeout_s, bool)
                                            or not isinstance(block_timeout_s, int | float)
                                            or not 0 <= block_timeout_s < float("inf")):
            raise ValueError(f"block_timeout_s must be a finite number of seconds >= 0, or None (wait as long as it "
                             f"takes), got {block_timeout_s!r}")
        if int(compact_every) < 0 or int(compact_every) == 1:
            raise ValueError(f"compact_every must be 0 (no background compaction) or >= 2 (the units merged at a "
                             f"time), got {compact_every}")
        if not isinstance(loss_rule, str) or not loss_rule:
            raise ValueError(f"loss_rule must be a non-empty string, got {loss_rule!r}")
        settings = _rule_settings(rule_settings)
        if loss_params is not None and not isinstance(loss_params, Mapping):
            raise ValueError(f"loss_params must be a mapping of the rule's parameters, got {loss_params!r}")
        if mu_source not in MU_SOURCES:
            raise ValueError(f"mu_source must be one of {sorted(MU_SOURCES)}, got {mu_source!r}")
        extra = C.extra_columns(extra_columns)  # ValueError naming a bad name or type
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 (weight updates a sampling engine may lag the "
                             f"trainer) or None, got {max_staleness!r}")
        if routing_shape is not None:
            from trustscope.routing import check_routing_shape

            routing_shape = check_routing_shape(routing_shape)
        if routing_replay and routing_shape is None:
            raise ValueError("routing_replay=True needs routing_shape=(MoE layers, top-k, experts): replay is "
                             "declared for a mixture-of-experts model")
        from trustscope.logger.experts import check_fraction

        if routing_fraction is None and routing_shape is not None and not summaries:
            routing_fraction = 1.0  # no summaries: the routing figures are read from the token rows, so all of them
        routing_fraction = check_fraction(routing_fraction, routing_shape)  # ValueError naming it
        self.run_id = run_id or f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        if not set(self.run_id) <= RUN_ID_OK or self.run_id.startswith("."):
            raise ValueError(f"run_id {self.run_id!r} may only use letters, digits, '.', '_', '-' "
                             f"and must not start with '.'")
        self.rank = resolve_rank(rank)
        try:
            store = open_store(logdir, storage_options)
        except StorageError as err:
            raise LogDirError(f"log directory {str(logdir)!r} cannot be used: {err}") from None
        self.logdir: Path | str = store.logdir if not store.remote else store.url
        """The log directory: a Path, or the ``s3://`` URL of an object store prefix."""
        self.run_dir: Path | str = (store.logdir / self.run_id if not store.remote
                                    else f"{store.url}/{self.run_id}")
        self.strict = strict
        self.loss_rule = loss_rule
        self.mu_source = mu_source
        self.source = {"framework": "trustscope", "version": __version__} if source is None else dict(source)
        self._closed = False
        self._resumed = bool(resume)
        self._logged = False  # a log_step call reached the checks (cut_back only comes before)
        self._reported_dead = False
        self._storage_options = None if storage_options is None else dict(storage_options)
        texts = vocab_texts(vocab) if vocab is not None else None
        if texts is not None:
            try:
                check_text(texts, "vocab", "token id")
            except Rejected as err:
                raise SchemaError(str(err)) from None

        self._files = RunFiles(store, self.run_id, self.rank)
        try:
            self._files.open(resume)
        except BaseException:
            store.close()
            raise
        try:
            if tokenizer is None and vocab is not None and hasattr(vocab, "name_or_path"):
                tokenizer = {"name_or_path": str(vocab.name_or_path), "class": type(vocab).__name__}
            rule_name = loss_rule.replace(":", ".").rsplit(".", 1)[-1]
            own = dict(loss_params) if loss_params is not None else (
                dict(config.get("loss_params") or {}) if isinstance(config, Mapping)
                and str(config.get("loss", rule_name)).replace(":", ".").rsplit(".", 1)[-1] == rule_name else {})
            self._summary_rules = summary_rules(rule_name, own, tuple(settings))
            run_info = {"loss_rule": loss_rule, "mu_source": mu_source, "source": jsonable(self.source),
                        "config": jsonable(config), "model": jsonable(model), "sampling": jsonable(sampling),
                        "tokenizer": jsonable(tokenizer), "max_staleness": max_staleness,
                        **({"routing_shape": list(routing_shape)} if routing_shape else {}),
                        **({"routing_replay": True} if routing_replay else {}),
                        **({"routing_fraction": routing_fraction} if routing_shape else {}),
                        **({"loss_params": jsonable(dict(loss_params))} if loss_params is not None else {})}
            logging_info = {"token_fraction": float(token_fraction), "text_fraction": float(text_fraction),
                            "log_topk": log_topk,
                            "topk_precision": topk_precision, "topk_k": None, "summaries": summaries, "seed": int(seed), "strict": strict,
                            "flush_rows": int(flush_rows), "flush_seconds": float(flush_seconds),
                            "compact_every": int(compact_every), "max_queue": int(max_queue),
                            "max_buffered_rows": int(max_buffered_rows), "on_full": on_full,
                            "block_timeout_s": None if block_timeout_s is None else float(block_timeout_s),
                            "extra_columns": {c.name: str(extra_columns[c.name]) for c in extra},
                            "summary_rules": _recorded(self._summary_rules) if summaries else None}
            topk_k = self._files.start_manifest(resume, run_info, logging_info)
            if texts is not None and self.rank == 0:
                self._files.write_vocab(texts)
        except OSError as err:
            self._files.lock.release()
            store.close()
            raise LogDirError(f"log directory {str(self.logdir)!r} cannot be written: {err}") from err
        except BaseException:
            self._files.lock.release()
            store.close()
            raise
        self._checker = InputChecker(run_id=self.run_id, rank=self.rank, strict=strict, loss_rule=loss_rule,
                                     token_fraction=float(token_fraction), seed=int(seed),
                                     vocab_size=None if texts is None else len(texts), topk_k=topk_k,
                                     disk_last_step=self._files.disk_last_step, summaries=summaries,
                                     extra_columns=extra, routing_shape=routing_shape,
                                     routing_fraction=routing_fraction)
        prior = self._files.manifest.get("buffer") if resume else None
        self._budget = RowBudget(int(max_buffered_rows), int(max_queue), on_full,
                                 None if block_timeout_s is None else float(block_timeout_s),
                                 prior if isinstance(prior, dict) else None)
        self._files.note(buffer=self._budget.report())
        compact_every = int(compact_every) if background_compaction(self._files, int(compact_every)) else 0
        self._files.note(logging={**self._files.manifest["logging"], "compact_every": compact_every})
        self._compactor = (BackgroundCompactor(self._files, compact_every, int(row_group_size), fsync)
                           if compact_every else None)
        self._writer = Writer(self._files, run_id=self.run_id, rank=self.rank, log_topk=log_topk,
                              topk_precision=topk_precision, flush_rows=int(flush_rows),
                              flush_seconds=float(flush_seconds), max_queue=int(max_queue),
                              row_group_size=int(row_group_size), fsync=fsync, topk_k=topk_k,
                              write_threads=default_write_threads() if write_threads is None else int(write_threads),
                              blocked_rules=blocked_rule_list() if summaries else None,
                              summary_rules=self._summary_rules,
                              on_commit=None if self._compactor is None else self._compactor.committed,
                              budget=self._budget, decode=text_decoder(vocab, texts),
                              text_fraction=float(text_fraction), seed=int(seed),
                              extra_fields=tuple(c.field for c in extra))
        self._checker.lend_routing = not copy_routing
        self._writer.routing_changed = self._routing_changed
        self._incidents: dict[str, Any] = dict(self._files.manifest.get(INCIDENTS_KEY) or {}) if resume else {}
        self._incidents_due = False  # counters changed since the last call that logged them
        self._incidents_warned: set[str] = set()
        self._summary_calls = 0  # calls with summaries queued so far
        self._calls_through: dict[int, int] = {}  # step -> calls with summaries queued up to its last call
        self._atexit = _close_at_exit(self)
        atexit.register(self._atexit)

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
        """Check one step's (or micro-batch's) data and queue it for writing. See :mod:`trustscope.logger`."""
        if self._closed:
            raise RuntimeError(f"TokenLogger of run {self.run_id!r} is closed")
        self._raise_writer_error(step)
        self._logged = True
        due = self._incidents_due
        if due:  # the incident counters so far ride along with this step's scalars
            scalars = {**incident_counters(self._incidents), **(scalars or {})}
        try:
            batch = self._checker.prepare(step, tokens, mask, samples, scalars, loss_rule)
        except (Rejected, SchemaError) as err:
            if self.strict:
                raise SchemaError(str(err)) from None
            warnings.warn(f"trustscope: step {step} not logged: {err}", LogWarning, stacklevel=2)
            return
        if self._budget.admit(batch, lambda: self._writer.alive, self._writer.ask_room):
            self._files.note(buffer=self._budget.report())
        if batch.summarize and batch.tokens is not None:
            self._summary_calls += 1
            self._calls_through[batch.step] = self._summary_calls
            if len(self._calls_through) > 4:  # only the newest steps are ever asked about
                del self._calls_through[min(self._calls_through)]
        if due:
            self._incidents_due = False
        if not self._writer.put(batch):
            self._writer.lose(batch)
            self._raise_writer_error(step)

    def commit_step(self) -> None:
        """Have the writer thread store and commit everything logged so far, and return at once: a step ends
        committed without closing the logger (Parquet encoding, fsync, the manifest and compaction stay on the
        logger's threads). Readers see it once the thread is through; :meth:`flush` is the call that waits."""
        if self._closed:
            return
        self._raise_writer_error()
        self._writer.commit()

    def cut_back(self, step: int, *, ranks: Container[int] | None = None, world: int | None = None) -> int:
        """Drop what this rank logged after ``step``, the step a framework resumes from (its checkpoint's), so the
        resumed steps are logged once; returns how many files went. Only on a logger opened with ``resume=True``,
        before its first :meth:`log_step`. Works on local and ``s3://`` runs.

        ``ranks``: other ranks of the run to cut back at ``step`` as well (e.g. ``range(1, 2**31)`` from a driver
        that resumes every actor's log). ``world``: the number of ranks the resumed run has; ranks at or beyond
        it that logged before (a resume on fewer processes) are cut back too, so no process's later rows are
        left behind, and a resume on another number of ranks is a ``resume_ranks_changed`` incident.

        A rank whose committed steps end before ``step`` (a checkpoint newer than the log) is never a reason to
        stop the training: nothing of it is cut, and it becomes a ``resume_log_short`` incident (one warning, the
        manifest's ``incidents``, which ``trustscope validate`` names, and the ``trustscope/incidents/...``
        counters among the next step's scalars: :mod:`trustscope.runformat.incidents`). A run another schema
        version wrote is refused (:class:`~trustscope.runformat.cutback.ResumeError`) before anything is cut.
        ``step = -1`` drops everything (a framework that starts over)."""
        if self._closed:
            raise RuntimeError(f"TokenLogger of run {self.run_id!r} is closed")
        if not self._resumed or self._logged:
            raise RuntimeError(f"cut_back({step}) on run {self.run_id!r} rank {self.rank}: only a logger opened with "
                               f"resume=True can cut back, before its first log_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < -1:
            raise ValueError(f"step must be an int >= -1, got {step!r}")
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise ValueError(f"world must be the resumed run's number of ranks, an int >= 1, got {world!r}")
        self._writer.flush()  # nothing was logged: only a heartbeat could be under way
        removed = 0
        try:
            if short_of(self._files.manifest, step):
                self._short_log(self.rank, self._files.manifest.get("last_step"), step)
            else:
                removed = self._files.cut_after(step)
            if ranks is not None or world is not None:
                removed += self._cut_other_ranks(step, ranks, world)
            if self._incidents_due:
                self._files.save()  # the incidents are on disk before training goes on
        except OSError as err:
            raise LogDirError(f"run {self.run_id!r} rank {self.rank} could not be cut back after step {step}: "
                              f"{err}") from err
        self._checker._disk_last_step = self._files.disk_last_step  # the steps a resumed rank may log
        return removed

    def _cut_other_ranks(self, step: int, ranks: Container[int] | None, world: int | None) -> int:
        """:meth:`cut_back` of the other ranks named by ``ranks`` or at or beyond ``world``."""
        manifests = store_manifests(self._files.store, self._files.run_dir)
        if world is not None:
            had = max(manifests) + 1
            if had != world:
                which = (f"ranks {world}-{had - 1}, which no process writes now, are cut back after step {step} "
                         f"like the others" if had > world else
                         f"ranks {had}-{world - 1} are new and start after step {step}")
                self.record_incident("resume_ranks_changed", f"run {self.run_id!r} resumed on {world} rank(s) after "
                                     f"step {step}; it had {had}: {which}", step)
        removed = 0
        for rank, manifest in sorted(manifests.items()):
            if rank == self.rank or not ((ranks is not None and rank in ranks) or (world is not None and rank >= world)):
                continue
            if short_of(manifest, step):
                self._short_log(rank, manifest.get("last_step"), step)
                continue
            removed += drop_steps_after(self.run_dir, step, ranks={rank}, storage_options=self._storage_options,
                                        resume=True)
        return removed

    def _short_log(self, rank: int, last: int | None, step: int) -> None:
        self.record_incident("resume_log_short", short_detail(self.run_id, rank, last, step), step)

    def record_incident(self, kind: str, detail: str, step: int | None = None) -> None:
        """Record a logging incident of ``kind`` (:data:`trustscope.runformat.incidents.INCIDENTS`): a
        :class:`LogWarning` (the first of each kind), the manifest's ``incidents`` (written with the next save),
        and the ``trustscope/incidents/<kind>`` counter among the next logged step's scalars. Any thread."""
        self._incidents = add_incident(self._incidents, kind, detail, step)
        self._incidents_due = True
        self._files.note(**{INCIDENTS_KEY: self._incidents})
        if kind not in self._incidents_warned:
            self._incidents_warned.add(kind)
            warnings.warn(f"trustscope: {detail} (logging incident {kind}: counted in the manifest and in the "
                          f"{INCIDENT_PREFIX}{kind} scalar; trustscope validate names it)", LogWarning, stacklevel=3)

    def _routing_changed(self, step: int, what: str) -> None:
        """Writer thread: a lent routing buffer changed before it was read; routing is copied from now on."""
        self._checker.lend_routing = False
        self.record_incident("routing_buffer_changed", f"run {self.run_id!r} rank {self.rank} step {step}: a routed-"
                             f"expert buffer given to log_step changed before the writer thread had read it ({what}); "
                             f"that call's routing columns are left out, and routing is copied at the call from now "
                             f"on (TokenLogger(copy_routing=True) copies from the start)", step)

    @property
    def incidents(self) -> dict[str, Any]:
        """The logging incidents of this rank so far (the manifest's ``incidents``), over resumed sessions too."""
        return {k: dict(v) for k, v in self._incidents.items()}

    def step_summaries(self, wait_s: float = 0.0) -> tuple[int, list[dict[str, Any]]] | None:
        """``(step, rows)``: the exact summary rows (:mod:`trustscope.logger.summaries`, this rank's calls of the
        step merged) of the newest step whose calls logged so far the writer thread has all summarised, or None.

        Never waits on I/O by default: the rows are kept in memory as the writer thread summarises each call, so
        the answer is the newest whole step it has reached (``step`` says which; it may be a step behind the
        caller's). ``wait_s`` > 0 first waits up to that long for the thread to summarise every call logged so far
        (its flushes are written before it reaches later calls, so this may wait on them).
        :func:`trustscope.trackers.step_metrics` turns the rows into tracker metrics."""
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s < float("inf"):
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
        through = dict(self._calls_through)
        return self._writer.step_summaries(lambda step, done: through.get(step, 0) <= done, self._summary_calls,
                                           float(wait_s))

    def note_alerts(self, alerts: Mapping[str, Any]) -> None:
        """Record what the run's alerts did (:mod:`trustscope.alerts`) in this rank's manifest, key ``alerts``
        (written at the writer's next save: at most ``flush_seconds`` later, and at close). Any thread."""
        self._files.note(alerts=jsonable(dict(alerts)))

    def flush(self) -> None:
        """Block until everything logged so far is in committed Parquet files (visible to readers), then raise
        (strict) or warn about any write failure since the last call."""
        if self._closed:
            return
        self._writer.flush()
        self._raise_writer_error()

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Flush, stop the writer thread and mark this rank ``status`` in its manifest. Safe to call twice.

        When rows were lost to write failures a ``finished`` rank is recorded ``crashed``, with the error and
        what was lost (the manifest's ``lost`` key). A manifest that cannot be written raises :class:`LogDirError`.
        """
        if self._closed:
            return
        if status not in S.STATUSES:
            raise ValueError(f"status must be one of {S.STATUSES}, got {status!r}")
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            self._writer.stop()
            if self._compactor is not None:
                self._compactor.stop()
                self._compactor.tidy()
            lost, fatal = self._writer.lost, self._writer.fatal
            if fatal is not None and status == "finished":
                status, error = "crashed", f"writer thread stopped: {type(fatal).__name__}: {fatal}"
            elif lost is not None and status == "finished":
                status, error = "crashed", f"write error: {lost['errors'][0] if lost['errors'] else 'unknown'}"
            elif self._files.prior_lost and status == "finished" and error is None:
                prior = self._files.prior_lost
                error = (f"an earlier session lost {sum(prior.get('rows', {}).values())} row(s) of steps "
                         f"{prior.get('first_step')}-{prior.get('last_step')} (see lost)")
            self._files.note(buffer=self._budget.report())
            self._files.finish(status, error, lost)
        except OSError as err:
            raise LogDirError(f"trustscope could not write run {self.run_id!r}: {err}") from err
        finally:
            self._files.lock.release()
            self._files.store.close()
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
        return self._files.snapshot()

    @property
    def buffer(self) -> dict:
        """The memory bound and what it did so far (the manifest's ``buffer`` key), with ``rows``: the token rows
        waiting in memory now (queued, or in the open flush not yet stored)."""
        return {**self._budget.report(), "rows": self._budget.rows}

    def _raise_writer_error(self, step: int | None = None) -> None:
        failed = None if self._compactor is None else self._compactor.take_error()
        if failed is not None:  # nothing was lost: the files stay as they were, the next round tries again
            warnings.warn(f"trustscope: compaction of run {self.run_id!r} rank {self.rank} failed, its files "
                          f"stay as they are: {failed}", LogWarning, stacklevel=3)
        err = self._writer.take_error()
        if err is None:
            return
        dead = not self._writer.alive
        if self.strict:
            what = "its writer thread stopped" if dead else "a write failed"
            raise LogDirError(f"trustscope could not write run {self.run_id!r} ({what}): {err}") from err
        if dead and self._reported_dead:
            return
        self._reported_dead = dead
        lost = self._writer.lost or {}
        where = step if lost.get("last_step") is None else lost["last_step"]
        if dead:
            self.record_incident("writer_stopped", f"the writer thread of run {self.run_id!r} rank {self.rank} "
                                 f"stopped, its rows from here on are lost: {type(err).__name__}: {err}", where)
        else:
            self.record_incident("rows_lost", f"a write of run {self.run_id!r} rank {self.rank} failed, its rows "
                                 f"are lost: {type(err).__name__}: {err}", where)


def text_decoder(vocab: Any, texts: list[Any] | None) -> Callable[[list[np.ndarray]], list[str]] | None:
    """Token-id rows to texts on the writer thread: through the tokenizer's Rust ``decode_batch`` when ``vocab``
    is a Hugging Face tokenizer (special tokens skipped), else the vocab's token texts joined; None without a
    vocab."""
    tokenizer = getattr(vocab, "tokenizer", vocab)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda rows: backend.decode_batch([r.tolist() for r in rows], skip_special_tokens=True)
    if hasattr(tokenizer, "batch_decode"):
        return lambda rows: tokenizer.batch_decode([r.tolist() for r in rows], skip_special_tokens=True)
    if texts is None:
        return None
    table = np.array(["" if t is None else t for t in texts], dtype=object)
    return lambda rows: ["".join(table[r]) for r in rows]


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

    def step_summaries(self, wait_s: float = 0.0) -> None:
        return None

    def note_alerts(self, alerts: Mapping[str, Any]) -> None:
        pass

    @property
    def manifest(self) -> dict:
        return {}

    @property
    def buffer(self) -> dict:
        return {}

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _rule_settings(settings: Sequence[str]) -> list:
    """``rule_settings`` checked (:func:`trustscope.rule_settings.parse_settings`): a list of settings, not one
    string."""
    from trustscope.rule_settings import parse_settings

    if isinstance(settings, str):
        raise ValueError(f"rule_settings must be a list of rule settings (NAME@VALUE or NAME:param=value), got the "
                         f"string {settings!r}")
    parsed = parse_settings(settings)
    from trustscope.losses import list_losses

    clash = [s.name for s in parsed if s.name in list_losses()]
    if clash:
        raise ValueError(f"rule_settings: {clash[0]!r} is the rule at its defaults, which the summaries count "
                         f"already; give it other parameters")
    return parsed


def _recorded(rules: tuple) -> dict[str, dict[str, Any]]:
    """``run.json``'s ``logging.summary_rules``: what each ``rule`` value of the ``blocked`` summaries is, the rule
    and its mask's parameters (the ones the blocks depend on)."""
    from trustscope.losses import get_loss

    return {name: {"rule": rule, "params": jsonable({p: params[p] for p in get_loss(rule).mask_params})}
            for name, rule, params in rules}
