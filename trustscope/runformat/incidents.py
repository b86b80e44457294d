"""Logging incidents: what went wrong with the log itself while training went on.

A logger never stops the training for its own trouble. Each kind of trouble declared here becomes, where it
happens, one warning (:class:`~trustscope.runformat.errors.LogWarning`, once per kind and session), an entry under
the manifest key :data:`MANIFEST_KEY` of the rank that saw it (``trustscope validate`` names it:
:func:`incident_problems`), and a counter among the step's scalars, ``trustscope/incidents/<kind>`` (the count so
far, written with the next step the logger logs). Declared once here: the logger, the cut-back at resume, the
validator and the docs table (``docs/logging.md``) read :data:`INCIDENTS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MANIFEST_KEY = "incidents"
SCALAR_PREFIX = "trustscope/incidents/"


@dataclass(frozen=True)
class Incident:
    """One kind of logging incident: its name (the manifest key and the scalar's suffix) and what it means."""

    name: str
    means: str
    rows: str
    """What became of the rows concerned (the docs table's last column)."""


INCIDENTS: tuple[Incident, ...] = (
    Incident("resume_log_short", "a rank's log ends before the step the run resumed from (a checkpoint newer than "
             "the log: a wait for the writer that timed out, an `s3://` store, a killed writer)",
             "the steps between are missing from that rank; nothing is cut, every committed row stays"),
    Incident("resume_ranks_changed", "the run resumed on another number of ranks than it had",
             "fewer: the ranks no process writes any more are cut back to the checkpoint like the others; more: "
             "the new ranks start at the checkpoint"),
    Incident("rows_lost", "a write failed (a full disk, a store past its retries) and the flush's rows could not "
             "be committed", "lost, counted per table in the manifest's `lost` key; the rows before stay"),
    Incident("routing_buffer_changed", "a routed-expert buffer lent to `log_step` (not copied at the call) was "
             "changed by the caller before the writer thread had read it: a framework that refills one buffer",
             "that call's routing columns are null, its other columns kept; later calls' routing is copied at the "
             "call"),
    Incident("writer_stopped", "the logger's writer thread died (out of memory, a bug)",
             "every later row is counted lost; the committed ones stay"),
)
"""Every kind of logging incident."""

KINDS = {i.name: i for i in INCIDENTS}


def check_kind(kind: str) -> Incident:
    if kind not in KINDS:
        raise ValueError(f"incident kind {kind!r} is not one of {sorted(KINDS)}")
    return KINDS[kind]


def add_incident(record: Mapping[str, Any] | None, kind: str, detail: str, step: int | None = None
                 ) -> dict[str, Any]:
    """``record`` (a manifest's :data:`MANIFEST_KEY` value, or None) with one more incident of ``kind``: per kind
    its ``count``, the ``first`` and ``last`` details (the first one is the one to read) and the steps it concerned
    (``first_step``, ``last_step``)."""
    check_kind(kind)
    out = {k: dict(v) for k, v in (record or {}).items() if isinstance(v, Mapping)}
    entry = out.setdefault(kind, {"count": 0, "first": detail, "first_step": step, "last_step": step})
    entry["count"] = int(entry.get("count", 0)) + 1
    entry["last"] = detail
    if step is not None:
        steps = [s for s in (entry.get("first_step"), entry.get("last_step"), step) if isinstance(s, int)]
        entry["first_step"], entry["last_step"] = min(steps), max(steps)
    return out


def counters(record: Mapping[str, Any] | None) -> dict[str, float]:
    """The step scalars of ``record``: ``trustscope/incidents/<kind>`` = the count so far, per kind seen."""
    return {f"{SCALAR_PREFIX}{kind}": float(entry.get("count", 0)) for kind, entry in (record or {}).items()
            if kind in KINDS and isinstance(entry, Mapping)}


def incident_problems(manifest: Mapping[str, Any]) -> list[str]:
    """What ``trustscope validate`` says of a rank manifest's incidents: one line per kind, with its count and the
    first detail."""
    record = manifest.get(MANIFEST_KEY)
    if not record:
        return []
    if not isinstance(record, Mapping):
        return [f"{MANIFEST_KEY} is {type(record).__name__}, expected an object of incident kinds"]
    out = []
    rank = manifest.get("rank", 0)
    for kind, entry in record.items():
        if kind not in KINDS or not isinstance(entry, Mapping):
            out.append(f"{MANIFEST_KEY}: unknown incident kind {kind!r} (known: {sorted(KINDS)})")
            continue
        n = entry.get("count", 0)
        steps = ("" if entry.get("first_step") is None else
                 f" (steps {entry['first_step']}-{entry['last_step']})")
        out.append(f"logging incident {kind} x{n} seen by rank {rank}{steps}: {entry.get('first')}; "
                   f"{KINDS[kind].rows}")
    return out


def markdown_table() -> str:
    """The incidents as the table of ``docs/logging.md`` ("Logging incidents"), from :data:`INCIDENTS`."""
    lines = ["| incident | what happened | the rows concerned |", "|---|---|---|"]
    lines += [f"| `{i.name}` | {i.means} | {i.rows} |" for i in INCIDENTS]
    return "\n".join(lines)
