"""Status readers the dashboard and ``trustscope ls`` call: each rank's effective status (a running rank whose manifest
went stale counts as crashed), the run's status and summary.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trustscope.runformat.layout import TABLES
from trustscope.runformat.locks import pid_alive
from trustscope.runformat.manifest import rank_manifests

STALE_AFTER_FLUSHES = 4
"""A ``running`` rank whose manifest is older than this many ``flush_seconds`` (and :data:`STALE_MIN_S`) reads
``stale``: its writer updates the manifest at least once per ``flush_seconds`` while it lives."""


STALE_MIN_S = 120.0


def _stale_after(manifest: dict) -> float:
    flush_seconds = manifest.get("logging", {}).get("flush_seconds")
    if not isinstance(flush_seconds, int | float):
        return float("inf")  # a logger that did not promise updates: never stale
    return max(STALE_AFTER_FLUSHES * float(flush_seconds), STALE_MIN_S)


def _age_s(stamp: Any, at: datetime) -> float | None:
    try:
        return (at - datetime.fromisoformat(stamp)).total_seconds()
    except (TypeError, ValueError):
        return None


def effective_status(manifest: dict, at: datetime | None = None) -> str:
    """The status of one rank as it really is: ``running`` as written may be ``crashed`` (its writer process on
    this host is gone) or ``stale`` (no manifest update for :data:`STALE_AFTER_FLUSHES` flush intervals: the
    writer died inside a live process, or its host is unreachable)."""
    status = manifest.get("status", "running")
    if status != "running":
        return status
    if manifest.get("hostname") == socket.gethostname() and isinstance(manifest.get("pid"), int):
        if not pid_alive(manifest["pid"], manifest.get("pid_start")):
            return "crashed"
    age = _age_s(manifest.get("updated_at"), at or datetime.now(UTC))
    if age is not None and age > _stale_after(manifest):
        return "stale"
    return "running"


def rank_statuses(run_dir: str | os.PathLike) -> dict[int, str]:
    """Effective status of every rank of a run (:func:`effective_status`): running, stale, finished or crashed."""
    at = datetime.now(UTC)
    return {rank: effective_status(m, at) for rank, m in rank_manifests(Path(run_dir)).items()}


def _worst(statuses: Sequence[str]) -> str:
    for status in ("crashed", "stale", "running"):
        if status in statuses:
            return status
    return "finished"


def run_status(run_dir: str | os.PathLike) -> str:
    """Effective status of a run: ``crashed`` if any rank crashed, else ``stale`` if any is stale, else
    ``running`` if any runs, else ``finished``."""
    return _worst(list(rank_statuses(run_dir).values()))


def run_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """What the run was and where it stands, over all its ranks, for the Runs table.

    Keys: ``run_id``, ``status`` (as :func:`run_status`), ``ranks`` ({rank: status}), ``loss_rule``,
    ``mu_source``, ``source``, ``token_fraction`` (the fraction of sequences whose tokens are logged),
    ``tokens_generated`` (masked response tokens handed to ``log_step``), ``tokens_logged`` (token rows written
    after sampling and dropping; both None when a rank's files come from a logger that did not count them),
    ``rows`` ({table: rows committed}), ``last_step``, ``created_at``, ``updated_at`` (the latest manifest update
    of any rank), ``finished_at``, ``error`` (the first rank's error, or None) and ``lost`` ({rank: what its
    writer failed to write}, empty when nothing was lost).
    """
    run_dir = Path(run_dir)
    manifests = rank_manifests(run_dir)
    at = datetime.now(UTC)
    ranks = {rank: effective_status(m, at) for rank, m in sorted(manifests.items())}
    head = manifests.get(0, next(iter(manifests.values())))

    def total(key: str) -> int | None:
        values = [m.get(key) for m in manifests.values()]
        return None if any(not isinstance(v, int) for v in values) else sum(values)

    last_steps = [m["last_step"] for m in manifests.values() if isinstance(m.get("last_step"), int)]
    finished = [m.get("finished_at") for m in manifests.values()]
    errors = [m["error"] for _, m in sorted(manifests.items()) if m.get("error")]
    return {
        "run_id": head.get("run_id", run_dir.name),
        "status": _worst(list(ranks.values())),
        "ranks": ranks,
        "loss_rule": head.get("loss_rule"),
        "mu_source": head.get("mu_source"),
        "source": head.get("source"),
        "token_fraction": head.get("logging", {}).get("token_fraction"),
        "tokens_generated": total("tokens_generated"),
        "tokens_logged": total("tokens_logged"),
        "rows": {t: sum(int(m.get("rows", {}).get(t, 0)) for m in manifests.values()) for t in TABLES},
        "last_step": max(last_steps) if last_steps else None,
        "created_at": head.get("created_at"),
        "updated_at": max((m["updated_at"] for m in manifests.values() if m.get("updated_at")), default=None),
        "finished_at": None if None in finished else max(finished),
        "error": errors[0] if errors else None,
        "lost": {rank: m["lost"] for rank, m in sorted(manifests.items()) if m.get("lost")},
    }
