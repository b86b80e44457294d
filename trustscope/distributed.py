"""The kept aggregates' first pass on a Ray cluster: the tokens files that miss partial aggregates go out as Ray
tasks, a small batch of files each, and every task opens its own DuckDB over only its files.

    db = connect("/shared/logs", ray="auto")        # or "HOST:PORT", "ray://HOST:PORT"
    db.step_summary()                              # new files aggregated as Ray tasks, then kept as usual
    db.aggregator.tasks                            # where each task ran (TaskRecord: pid, node, worker, task ids)

A task gets the paths of its files (storage every node reads at the same path), the rendered ``rule_blocks`` view,
the bound parameters (every rule's parameters, each run's own rule set, the analysis settings) and the driver's
SQL fingerprint. It loads the macros and views of the trustscope installed on its node, and refuses to run when
their fingerprint differs from the driver's (another trustscope version there). It then runs the same statements
the local pass runs (:func:`trustscope.query.partials.aggregate_partials`) with the same parameters, so the rows it returns
are the local pass's rows. Per file it returns every partial view's rows as pyarrow tables, and the driver keeps
them in memory and on disk as it keeps its own (:class:`trustscope.query.partials.KeptAggregates`).

Reaching the cluster: :func:`attach_ray` first opens a TCP connection to the address (``PROBE_TIMEOUT_S``),
because ``ray.init`` on an address where nothing listens retries for minutes. Only then does it call
``ray.init(address=..., ignore_reinit_error=True)``. A process that has already called ``ray.init`` keeps that
cluster. A cluster that cannot be reached warns and leaves the aggregation to this machine, or raises
:class:`RayUnavailable`, as the caller chose; either way this happens in ``connect``, not at the first query.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from trustscope.query import catalogue
from trustscope.query.partials import Variant, aggregate_partials, batch_flushes, flush_groups

RAY_FALLBACKS = ("warn", "error")
"""What ``connect(..., ray_fallback=...)`` does when the cluster cannot be reached: warn and aggregate here, or raise."""
PROBE_TIMEOUT_S = 5.0
"""Seconds the TCP probe of a Ray address waits for a connection."""
TASKS_PER_CPU = 2
"""Tasks per cluster CPU a cold pass is split into (whole files each), so that a slow task does not hold the rest."""
MAX_FILES_PER_TASK = 8
"""Files one task aggregates at most: its DuckDB set-up is paid once per task, its results come back together."""
RAY_PIN = "ray==2.60.0"
"""The Ray release this module is tested with (the ``verl-deps`` extra installs it)."""


class RayUnavailable(ConnectionError):
    """The Ray cluster named cannot be reached, raised by ``connect`` when ``ray_fallback="error"``."""


class RayUnavailableWarning(UserWarning):
    """The Ray cluster named cannot be reached; the files are aggregated on this machine."""


@dataclass(frozen=True)
class TaskSpec:
    """What every task of one cold pass shares (put in Ray's object store once): ``rule_blocks``, the rendered view;
    ``fingerprint``, the driver's hash of its SQL and that view; ``params``, the bound ``trustscope_params``;
    ``variants``, per flush, the view that reads the logger's bits."""

    rule_blocks: str
    fingerprint: str
    params: dict[str, Any]
    variants: dict[str, Variant] = field(default_factory=dict)
    """Per flush (its first file's path): the driver's :func:`~trustscope.query.partials.stored_variant`, the
    ``rule_blocks`` SQL that reads the logger's bits."""
    views: tuple[str, ...] | None = None
    """The partial views to compute (None: every one)."""


@dataclass(frozen=True)
class TaskRecord:
    """Where one Ray task ran: its files, the worker's process id, Ray's node, worker and task ids, and the
    seconds the task took inside the worker."""

    files: tuple[str, ...]
    pid: int
    node_id: str
    worker_id: str
    task_id: str
    seconds: float


def aggregate_files(spec: TaskSpec, files: Sequence[str], threads: int | None = None
                    ) -> list[tuple[str, dict[str, pa.Table]]]:
    """``(file, every partial view's rows)`` for each tokens file, in a DuckDB of its own (no Ray needed).

    The connection has only what the partial views read (:func:`trustscope.query.catalogue.install` of the partial
    views), ``spec``'s parameters, and file lists that hold the tables' empty files plus one batch of flushes'
    tokens files at a time (a flush's parts together, see :func:`~trustscope.query.partials.aggregate_partials`).
    It may read only the files' directories. ``threads`` caps DuckDB's threads (a Ray task's CPUs).
    Raises RuntimeError when this trustscope's SQL differs from the driver's.
    """
    mine = catalogue.fingerprint(spec.rule_blocks)
    if mine != spec.fingerprint:
        raise RuntimeError(f"trustscope's SQL on {socket.gethostname()} differs from the driver's (fingerprint "
                           f"{mine[:12]} vs {spec.fingerprint[:12]}): install the driver's trustscope version there")
    with tempfile.TemporaryDirectory(prefix="trustscope-task-") as folder:
        lists = catalogue.write_empty_files(Path(folder))
        con = duckdb.connect(config={**catalogue.CONNECTION_CONFIG, **({"threads": threads} if threads else {})})
        try:
            con.execute("set variable trustscope_files = ?", [lists])
            con.execute("set variable trustscope_params = ?", [spec.params])
            catalogue.install(con, spec.rule_blocks, views=list(catalogue.CACHED_PARTIALS),
                              on_partial=lambda view: None)
            readable = [*sorted({str(Path(f).parent) + os.sep for f in files}), folder + os.sep]
            con.execute("set allowed_directories = ?", [readable])
            con.execute("set enable_external_access = false")
            con.execute("set lock_configuration = true")
            out = []
            flushes = flush_groups(files)  # a flush's parts together (see aggregate_partials)
            for batch, variant in batch_flushes(flushes, [spec.variants.get(f[0]) for f in flushes]):
                cur = con.cursor()  # its own temporary rule_blocks, dropped on close
                try:
                    cur.execute("set variable trustscope_files = ?", [{**lists, "tokens": [*lists["tokens"], *batch]}])
                    cur.execute("set variable trustscope_params = ?", [spec.params])
                    out += zip(batch, aggregate_partials(cur, batch, variant, spec.views), strict=True)
                finally:
                    cur.close()
            return out
        finally:
            con.close()


def _ray_task(spec: TaskSpec, files: list[str]) -> tuple[list[tuple[str, dict[str, pa.Table]]], TaskRecord]:
    """The body of one Ray task: :func:`aggregate_files` on the task's CPUs, and where it ran."""
    import ray

    start = time.perf_counter()
    context = ray.get_runtime_context()
    threads = max(1, int(context.get_assigned_resources().get("CPU", 1)))
    results = aggregate_files(spec, files, threads=threads)
    record = TaskRecord(tuple(files), os.getpid(), context.get_node_id(), context.get_worker_id(),
                        context.get_task_id() or "", time.perf_counter() - start)
    return results, record


class RayAggregator:
    """Runs the cold pass as Ray tasks on the cluster this process is attached to (see :func:`attach_ray`): an
    :class:`~trustscope.query.partials.Aggregator`."""

    def __init__(self, address: str) -> None:
        import ray

        self.address = address
        self.tasks: list[TaskRecord] = []
        """Every task this connection ran, in the order they finished."""
        self._remote = ray.remote(num_cpus=1)(_ray_task)

    def batches(self, files: Sequence[Path]) -> list[list[Path]]:
        """``files`` in consecutive batches: about :data:`TASKS_PER_CPU` tasks per cluster CPU, at most
        :data:`MAX_FILES_PER_TASK` files each."""
        import ray

        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        size = min(MAX_FILES_PER_TASK, max(1, len(files) // (TASKS_PER_CPU * cpus)))
        flushes = flush_groups(files)  # a flush's parts stay in one task
        size = max(1, size // max(len(f) for f in flushes)) if flushes else size
        return [[f for flush in flushes[i:i + size] for f in flush] for i in range(0, len(flushes), size)]

    def aggregate(self, files: Sequence[Path], *, rule_blocks: str, fingerprint: str, params: dict[str, Any],
                  variants: dict[str, Variant] | None = None, views: Sequence[str] | None = None
                  ) -> Iterator[tuple[Path, dict[str, pa.Table]]]:
        """``(file, every partial view's rows)`` for each of ``files``, as the tasks finish. A task's error is
        raised here (Ray's error is also an instance of the task's own exception class)."""
        import ray

        by_name = {str(f): f for f in files}
        spec = ray.put(TaskSpec(rule_blocks, fingerprint, params, variants or {},
                                None if views is None else tuple(views)))
        pending = [self._remote.remote(spec, [str(f) for f in batch]) for batch in self.batches(files)]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results, record = ray.get(done[0])
                self.tasks.append(record)
                for name, tables in results:
                    yield by_name[name], tables
        finally:
            for ref in pending:
                ray.cancel(ref)


def _host_port(address: str) -> tuple[str, int]:
    """Host and port of ``HOST:PORT`` or ``ray://HOST:PORT``; ValueError naming the value otherwise."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit():
        raise ValueError(f"ray={address!r} is not 'auto', HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def _unreachable(ray: Any, address: str) -> str | None:
    """Why this process cannot attach to ``address``, or None once it is attached."""
    target = address
    if address == "auto":
        if ray.is_initialized():
            return None
        target = os.environ.get("RAY_ADDRESS", "")
        if not target:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            try:  # what ray.init("auto") would join: the latest `ray start`, else a running GCS on this machine
                target = canonicalize_bootstrap_address_or_die("auto")
            except ConnectionError as err:
                return str(err)
    try:
        host, port = _host_port(target)
    except ValueError:  # only RAY_ADDRESS can be malformed here: attach_ray checked the address it was given
        return f"RAY_ADDRESS={target!r} is not HOST:PORT or ray://HOST:PORT"
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        return f"no connection to {host}:{port} ({err})"
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    except Exception as err:  # ray.init raises ConnectionError, RuntimeError, ValueError... for a cluster it cannot join
        return f"ray.init failed: {type(err).__name__}: {err}"
    return None


def attach_ray(address: str | None, fallback: str = "warn") -> RayAggregator | None:
    """The cluster at ``address`` (``"auto"``, ``HOST:PORT`` or ``ray://HOST:PORT``) to aggregate on, or None
    (no address; or unreachable with ``fallback="warn"``, after a :class:`RayUnavailableWarning` naming the
    address and the cause). ``fallback="error"`` raises :class:`RayUnavailable` instead. A malformed address or
    fallback raises ValueError whatever the fallback."""
    if fallback not in RAY_FALLBACKS:
        raise ValueError(f"ray_fallback={fallback!r} is not one of {', '.join(RAY_FALLBACKS)}")
    if address is None:
        return None
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"ray={address!r} is not 'auto', HOST:PORT or ray://HOST:PORT")
    if address != "auto":
        _host_port(address)
    try:
        import ray
    except ImportError as err:
        cause: str | None = f"ray is not installed ({err}); pip install '{RAY_PIN}'"
    else:
        cause = _unreachable(ray, address)
    if cause is None:
        return RayAggregator(address)
    message = f"Ray cluster {address!r} cannot be reached: {cause}"
    if fallback == "error":
        raise RayUnavailable(message)
    warnings.warn(f"{message}; aggregating on this machine instead", RayUnavailableWarning, stacklevel=3)
    return None
