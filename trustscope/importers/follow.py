"""Follow a running job: ``trustscope import --follow FORMAT SRC LOGDIR`` appends each step of another framework's
dump to one trustscope run once its writer has finished it, so the dashboard is live on that job.

When a step is finished is each format's own knowledge, declared with its importer: ``finished=`` of
:func:`~trustscope.importers.base.register_importer` (e.g. prime-rl's ``STABLE`` marker, NeMo-RL's closed last
line, slime's later rollout; see each format's ``finished_steps``). A format that declares none cannot be
followed. Steps are imported in order, each only once the steps before it in the source are (a step finished
before an earlier one waits for it).

Each step is read by the format's importer alone (``steps={n}``), checked, and logged through one
:class:`~trustscope.logger.TokenLogger` per source rank with one ``log_step`` call per rank; the ranks other
than 0 are flushed first and rank 0 last. The position is what the run has committed, nothing else: rank 0's
``last_step`` is the last step every rank has, and a rank whose ``last_step`` is already at a step (it committed
before the follower was stopped) is not given that step again. Stopping (idle, Ctrl-C: both finish the step being
imported first) or killing the follower and starting it again therefore imports nothing twice and loses nothing.

A finished step that does not parse stops the follower with the file and line (the importer's error): the steps
committed before stay, and a restart once the file is fixed or removed resumes at that step. Steps are appended in
order and a run cannot take an earlier step later, so skipping it would lose it for good. A source that
disappears stops the follower the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trustscope.importers.base import (
    IMPORTERS,
    ImportedRun,
    ImportFormatError,
    Listing,
    SourceGone,
    check_values,
    checked_options,
    format_for,
    name_unknown,
)
from trustscope.importers.writer import check_routing, log_step, routing_shape, unscored

__all__ = ["FollowResult", "SourceGone", "follow", "followed_formats"]

UNSCORED_SCALAR = "import/unscored_tokens"
"""The per-step scalar counting the trained tokens left out as unscored (a one-shot import counts them in
``config.import.unscored_tokens``)."""


def followed_formats() -> list[str]:
    """The registered formats that can be followed (those that declare ``finished``)."""
    return [name for name, fmt in IMPORTERS.items() if fmt.finished is not None]


@dataclass
class FollowResult:
    """What a follow session did: the run directory, the steps it imported, why it stopped."""

    run_dir: Path
    imported: list[int]
    last_step: int | None
    stopped: str  # "idle", "stopped" (should_stop), "interrupted" (Ctrl-C)
    waiting: list[int]  # steps of the source not finished (or behind an unfinished one) when it stopped


class _DeferInterrupt:
    """Ctrl-C during a step's import is held until the step is committed (main thread only)."""

    def __init__(self) -> None:
        self.asked = False
        self._old: Any = None

    def __enter__(self) -> _DeferInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        self.asked = True

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        if self.asked and exc_type is None:
            raise KeyboardInterrupt


class _Run:
    """The trustscope run a follow session appends to: its loggers (opened per rank on first use, always as a
    resume, so a restart continues) and what each rank has committed."""

    def __init__(self, logdir: Path, run_id: str, fmt: str, src: Path, vocab: Any, token_fraction: float = 1.0):
        self.logdir, self.run_id, self.fmt, self.src, self.vocab = logdir, run_id, fmt, src, vocab
        self.token_fraction = token_fraction
        self.dir = logdir / run_id
        self.key = str(src.resolve())  # what a restart must follow again, however SRC is spelled
        self.loggers: dict[int, Any] = {}
        self.last: dict[int, int | None] = {}
        self.format: str | None = None
        self.extra: dict[str, str] | None = None
        """The run's own columns (``extra_columns``): the unknown fields of the first step, kept for the run."""
        self.named: set[str] = set()  # unknown fields already named
        self.routing: tuple[int, int, int] | bool | None = False
        """The run's ``routing_shape`` (routed experts: the first step's, :func:`routing_shape`), None without;
        False until the first step or run.json decides."""
        manifest = self.dir / "run.json"
        if manifest.exists():
            info = json.loads(manifest.read_text())
            self.extra = dict((info.get("logging") or {}).get("extra_columns") or {})
            self.routing = tuple(info["routing_shape"]) if info.get("routing_shape") else None
            follow = ((info.get("config") or {}).get("import") or {}).get("follow")
            if not isinstance(follow, dict) or follow.get("format") != fmt or follow.get("src") != self.key:
                was = (f"a followed import of {follow.get('format')} {follow.get('src')}"
                       if isinstance(follow, dict) else "not a followed import")
                raise FileExistsError(f"{self.dir} already exists and is {was}; choose another --run-id")
            self.format = (info.get("source") or {}).get("format")
            self.open(0)

    def open(self, rank: int, run: ImportedRun | None = None) -> Any:
        from trustscope.logger import TokenLogger

        if rank in self.loggers:
            return self.loggers[rank]
        config = source = None
        loss_rule = "imported"
        if run is not None:
            loss_rule = run.loss_rule
            if rank == 0:
                config = {"import": {"format": run.format, "src": str(self.src), "files": None,
                                     "sequences": None, "unscored_tokens": None, "columns": run.notes,
                                     "follow": {"format": self.fmt, "src": self.key}}}
                source = {"framework": run.framework, "version": run.version, "format": run.format,
                          "src": str(self.src)}
        # every step is committed by an explicit flush, one log_step call per rank: no automatic flush splits
        # a step (the memory bound is never reached: one step is in memory at a time, parsed already)
        if self.extra is None:
            self.extra = dict(run.extra_types) if run is not None else {}
        if self.routing is False:
            self.routing = routing_shape(run, self.vocab) if run is not None else None
        logger = TokenLogger(self.logdir, self.run_id, config=config, loss_rule=loss_rule, vocab=self.vocab,
                             mu_source="imported", source=source, rank=rank, resume=True,
                             summaries=self.token_fraction < 1.0, token_fraction=self.token_fraction,
                             max_buffered_rows=2**62, block_timeout_s=None, extra_columns=self.extra,
                             routing_shape=self.routing or None)
        self.loggers[rank] = logger
        last = logger.manifest.get("last_step")
        self.last[rank] = last if isinstance(last, int) else None
        return logger

    @property
    def last_step(self) -> int | None:
        """The last step every rank has committed (rank 0 commits each step last)."""
        return self.last.get(0)

    def add(self, step: int, run: ImportedRun) -> int:
        """Log and commit ``step`` (``run`` holds it alone); returns the token rows written."""
        vocab_size = None if self.vocab is None else len(self.vocab)
        for seq in run.sequences:
            check_values(seq, vocab_size)
        layout = run.format.split(";")[0]
        if self.format is None:
            self.format = run.format
        elif layout != self.format.split(";")[0]:
            raise ImportFormatError(f"{self.src} step {step}: {layout}, unlike the steps imported before "
                                    f"({self.format.split(';')[0]}): a run does not mix writer versions")
        ranks = sorted({s.rank for s in run.sequences} | {0})
        self.open(0, run)  # rank 0 first: it writes run.json
        for rank in ranks:
            self.open(rank, run)
        scalars = {**run.scalars.get(step, {}), UNSCORED_SCALAR: float(unscored(run.sequences))}
        need = [r for r in ranks if self.last[r] is None or self.last[r] < step]
        others = [r for r in need if r != 0]
        new = {n: w for n, w in run.unknown.items() if n not in self.named}
        if new:  # each unknown field named once per follow session
            name_unknown(dataclasses.replace(run, unknown=new), self.extra)
            self.named.update(new)
        if self.routing:
            check_routing(run, self.routing, f"{self.src} step {step}")
        log_step(self.loggers, step, run.sequences, scalars, ranks=others, extra_types=self.extra,
                 routing=bool(self.routing))
        for rank in others:
            self.loggers[rank].flush()
            self.last[rank] = step
        log_step(self.loggers, step, run.sequences, scalars, ranks=[0], extra_types=self.extra,
                 routing=bool(self.routing))
        self.loggers[0].flush()  # the step's commit point
        self.last[0] = step
        written = [s for s in run.sequences if s.rank in need]
        return int(sum(int(s.mask.sum()) for s in written)) - unscored(written)

    def close(self, status: str = "finished", error: str | None = None) -> None:
        for rank in sorted(self.loggers, reverse=True):  # rank 0 last
            with contextlib.suppress(Exception) if status != "finished" else contextlib.nullcontext():
                self.loggers.pop(rank).close(status=status, error=error)


def follow(fmt: str, src: str | Path, logdir: str | Path, *, run_id: str | None = None,
           version: str | None = None, vocab: Any = None, poll_s: float = 2.0, settle_s: float = 2.0,
           stop_after_idle_s: float | None = None, on_step: Callable[[int, int, int], None] | None = None,
           options: Mapping[str, Any] | None = None, should_stop: Callable[[], bool] | None = None,
           token_fraction: float = 1.0) -> FollowResult:
    """Follow ``src`` (format ``fmt``) into ``<logdir>/<run_id>`` until it has been idle ``stop_after_idle_s``
    (no new finished step), ``should_stop()`` is true, or Ctrl-C; see the module docstring.

    ``on_step(step, sequences, token_rows)`` is called after each step is committed. Errors: a finished step
    that does not parse raises :class:`ImportFormatError` (file and line first), a vanished source
    :class:`SourceGone`; in both cases the steps committed before stay, named in the message.
    """
    importer = format_for(fmt)
    if importer.finished is None:
        raise ImportFormatError(f"format {fmt!r} cannot be followed (followed: {', '.join(followed_formats())})")
    for name, value in (("poll_s", poll_s), ("settle_s", settle_s)):
        if not value >= 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if stop_after_idle_s is not None and not stop_after_idle_s >= 0:
        raise ValueError(f"stop_after_idle_s must be a number of seconds >= 0, got {stop_after_idle_s!r}")
    given = checked_options(fmt, dict(options or {}))
    src, logdir = Path(src), Path(logdir)
    if not src.exists():
        raise SourceGone(f"{src}: no such file or directory")
    run = _Run(logdir, run_id or f"{fmt}-{src.resolve().name}", fmt, src, vocab, token_fraction)
    imported: list[int] = []
    listing = Listing(frozenset(), frozenset())
    idle_since = time.monotonic()
    stopped = "interrupted"

    def kept() -> str:
        last = run.last_step
        return (f"steps through {last} are committed in {run.dir}" if last is not None
                else f"no step was committed in {run.dir}")

    try:
        while True:
            try:
                listing = importer.finished(src, settle_s, time.time())
            except (FileNotFoundError, NotADirectoryError, ImportFormatError) as err:
                if not src.exists():
                    raise SourceGone(f"{src}: disappeared while followed; {kept()}") from None
                raise ImportFormatError(f"{err}; {kept()}") from None
            new = False
            for step in sorted(listing.steps):
                if run.last_step is not None and step <= run.last_step:
                    continue
                if step not in listing.finished:
                    break  # steps are appended in order: the later ones wait for this one
                with _DeferInterrupt():  # a Ctrl-C meanwhile stops the follower once the step is committed
                    try:
                        part = importer.read(src, version=version, steps={step}, **given)
                        rows = run.add(step, part)
                    except (FileNotFoundError, ImportFormatError) as err:
                        if not src.exists():
                            raise SourceGone(f"{src}: disappeared while followed (during step {step}); "
                                             f"{kept()}") from None
                        raise ImportFormatError(f"{err}; step {step} is not imported, {kept()}") from None
                    imported.append(step)
                    new = True
                    if on_step is not None:
                        on_step(step, len(part.sequences), rows)
            now = time.monotonic()
            if new:
                idle_since = now
            if should_stop is not None and should_stop():
                stopped = "stopped"
                break
            if stop_after_idle_s is not None and now - idle_since >= stop_after_idle_s:
                stopped = "idle"
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stopped = "interrupted"
    except BaseException as err:
        run.close(status="crashed", error=f"follow stopped: {err}")
        raise
    run.close()
    last = run.last_step
    return FollowResult(run.dir, imported, last, stopped,
                        sorted(s for s in listing.steps if last is None or s > last))
