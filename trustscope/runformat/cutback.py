"""Cutting a run back at a step (``resume`` from an earlier checkpoint): the rank's files and compaction records past the
step dropped or rewritten, and its manifest's counts rebuilt from the footers of the files that remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from trustscope.runformat.commits import COMPACTED_KEY, committed_files, compaction_records
from trustscope.runformat.errors import LogWarning, SchemaError
from trustscope.runformat.footers import (
    ORIGINALS_META,
    OWN_META_PREFIXES,
    SOURCES_META,
    flush_firsts,
    read_footer,
)
from trustscope.runformat.fsops import replace_file
from trustscope.runformat.incidents import MANIFEST_KEY as INCIDENTS_KEY
from trustscope.runformat.incidents import add_incident
from trustscope.runformat.layout import (
    FLUSH_META_PREFIX,
    SCHEMA_VERSION,
    TABLES,
    WRITE_OPTIONS,
    DataFileName,
    compacted_file_name,
    parse_data_file,
    rank_file,
    table_of,
    tmp_path,
)
from trustscope.runformat.locks import NoLock, RunLock
from trustscope.runformat.manifest import now, store_manifests
from trustscope.runformat.recovery import recover_rank
from trustscope.runformat.stores import RunStore, open_store


def drop_steps_after(run_dir: str | os.PathLike, step: int, *, ranks: Container[int] | None = None,
                     storage_options: Mapping[str, Any] | None = None, resume: bool = False) -> int:
    """Remove every rank's flushes whose steps all come after ``step`` (a continuation that crashed past its last
    checkpoint) and recount each rank's manifest from the files that remain; returns how many files went.

    ``run_dir`` is a local run folder or an ``s3://`` run prefix (``storage_options`` as for
    :class:`~trustscope.logger.TokenLogger`); ``ranks``: only these ranks (any container, e.g. a ``range``;
    default: every rank with a manifest).
    Each rank is recovered first (:func:`~trustscope.runformat.recovery.recover_rank`: a flush a killed writer
    committed but had not all renamed into place is rolled forward), so such a flush is cut like any other.
    A flush is removed whole, in every table, so the run keeps whole steps; a flush that holds steps on both sides
    of ``step`` is refused (a logger that commits each step, as the integrations' do, never writes one). Each
    rank's lock is held meanwhile: a rank that a live logger writes is refused (:class:`LogDirError`; object
    storage has no lock). Token counts are rebuilt from the files' footers
    (:data:`trustscope.runformat.layout.FLUSH_META_PREFIX`); they become None where a file has none. A compacted file
    (:mod:`trustscope.runformat.compaction`) that holds flushes on both sides of ``step`` is written again with the
    kept flushes' rows, and the rank's compaction record changed with it.

    ``resume=True`` (a framework resuming from the checkpoint of ``step``): a rank written by another schema
    version is refused (:class:`ResumeError`) before anything is cut. A rank whose committed steps end before
    ``step`` (the steps between are missing from its log) never stops the resume: nothing of it is cut, a
    :class:`LogWarning` names the run, the rank and the steps, and its manifest records a ``resume_log_short``
    incident, which ``trustscope validate`` names (:mod:`trustscope.runformat.incidents`; a resuming
    :class:`~trustscope.logger.TokenLogger` counts it among the step's scalars too: ``cut_back(step, ranks=...)``).
    """

    text = str(run_dir).rstrip("/")
    logdir, _, run_id = text.rpartition("/")
    store = open_store(logdir or ".", storage_options)
    try:
        run = store.join(run_id)
        manifests = store_manifests(store, run)
        if ranks is not None:
            manifests = {r: m for r, m in manifests.items() if r in ranks}
        if resume:
            for rank, manifest in manifests.items():
                check_schema(manifest, run_id, rank, step)
            for rank, manifest in list(manifests.items()):
                if short_of(manifest, step):
                    del manifests[rank]
                    _record_short(store, run, run_id, rank, manifest, step)
        def listed() -> dict[str, list[Path]]:
            return committed_files(run, fs=store.fs) if store.remote else committed_files(run)

        committed = listed()
        removed = 0
        for rank, manifest in manifests.items():
            lock = NoLock(store.url) if store.remote else RunLock(run, rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LogWarning)  # no lock on object storage: said at open already
                lock.acquire(manifest.get("run_id", run_id), rank)
            try:
                # what a killed writer left half done first (a committed flush not all renamed into place is
                # rolled forward): cut before it, such a flush would stay half visible and escape the cut. The
                # run is listed again only where recovery changed something (it says what it did)
                if recover_rank(store, run, rank, manifest):
                    committed = listed()
                changes, gone = cut_rank(store, run, rank, manifest, step, committed)
                if changes is not None:
                    store.write_atomic(rank_file(run, rank), json.dumps({**manifest, **changes}, indent=2,
                                                                        default=str))
                for path in gone:
                    store.delete(path)
                    removed += 1
            finally:
                lock.release()
        return removed
    finally:
        store.close()


class ResumeError(SchemaError):
    """A run cannot be resumed at the step asked for: its log ends before that step, or another schema version
    wrote it. Names the run, the rank and the steps."""


def short_of(manifest: Mapping[str, Any], step: int) -> bool:
    """Whether a rank's committed steps end before ``step`` (a resume's checkpoint newer than its log)."""
    last = manifest.get("last_step")
    return step >= 0 and (last is None or last < step)


def short_detail(run_id: str, rank: int, last: int | None, step: int) -> str:
    return (f"run {run_id!r} resumed after step {step}, but rank {rank} logged only up to step {last}: steps "
            f"{0 if last is None else last + 1}-{step} are missing from it (nothing was cut)")


def _record_short(store: RunStore, run: Any, run_id: str, rank: int, manifest: dict, step: int) -> None:
    """A rank short of the resume's ``step``: warned, and a ``resume_log_short`` incident in its manifest."""
    detail = short_detail(run_id, rank, manifest.get("last_step"), step)
    lock = NoLock(store.url) if store.remote else RunLock(run, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogWarning)  # no lock on object storage: said at open already
        lock.acquire(manifest.get("run_id", run_id), rank)
    try:
        record = add_incident(manifest.get(INCIDENTS_KEY), "resume_log_short", detail, step)
        store.write_atomic(rank_file(run, rank), json.dumps({**manifest, INCIDENTS_KEY: record}, indent=2,
                                                            default=str))
    finally:
        lock.release()
    warnings.warn(f"trustscope: {detail} (logging incident resume_log_short: recorded in its manifest; trustscope "
                  f"validate names it)", LogWarning, stacklevel=3)


def check_schema(manifest: Mapping[str, Any], run_id: str, rank: int, step: int) -> None:
    """Refuse (:class:`ResumeError`) to resume rank ``rank`` of run ``run_id`` after ``step`` when its manifest
    was written by another schema version."""
    version = manifest.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ResumeError(f"run {run_id!r} rank {rank} was written with schema_version {version!r}; this trustscope "
                          f"writes {SCHEMA_VERSION} and cannot resume it at step {step}: log the continuation as "
                          f"a new run")


def check_resume(manifest: Mapping[str, Any], run_id: str, rank: int, step: int) -> None:
    """Refuse (:class:`ResumeError`) to resume rank ``rank`` of run ``run_id`` after ``step`` when its manifest
    was written by another schema version, or its committed steps end before ``step`` (the log would miss the
    steps in between: a checkpoint newer than the log). Resuming loggers and :func:`drop_steps_after` count the
    second as an incident instead (:func:`short_of`); this is for a tool that must refuse."""
    version = manifest.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ResumeError(f"run {run_id!r} rank {rank} was written with schema_version {version!r}; this trustscope "
                          f"writes {SCHEMA_VERSION} and cannot resume it at step {step}: log the continuation as "
                          f"a new run")
    last = manifest.get("last_step")
    if step >= 0 and (last is None or last < step):
        raise ResumeError(f"cannot resume run {run_id!r} after step {step}: rank {rank} logged only up to step "
                          f"{last} (the checkpoint is newer than the log, so steps {0 if last is None else last + 1}"
                          f"-{step} would be missing); resume from a checkpoint at or before step {last}, or log "
                          f"the continuation as a new run")


def _cut_record(store: RunStore, run: Any, rank: int, record: dict, step: int) -> tuple[dict | None, list]:
    """:func:`~trustscope.runformat.cutback.cut_compacted` through ``store``: an object store's files are cut in
    a local copy and the new files uploaded. Returns the new record (None: nothing kept) and the files written."""

    originals = [o for rel in record["files"]
                 for o in json.loads((read_footer(store, run / rel).metadata or {}).get(ORIGINALS_META.encode(), b"[]"))]
    across = sorted({(o[1], o[2], o[3]) for o in originals if o[2] <= step < o[3]})
    if across:
        flush, first, last = across[0]
        raise ResumeError(f"run {str(run)!r} rank {rank}: flush {flush} holds steps {first}-{last}, on both sides "
                          f"of step {step}; it cannot be cut there")
    if all(o[2] <= step for o in originals):
        return record, []
    if not store.remote:
        return cut_compacted(run, rank, record, step)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trustscope-cut-") as tmp:
        local = Path(tmp)
        for rel in record["files"]:
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(store.read_bytes(run / rel))
        new, written = cut_compacted(local, rank, record, step, fsync=False)
        finals = []
        try:
            for path in written:
                final = run / path.relative_to(local).as_posix()
                finals.append(final)
                store.publish(path, final, fsync=False)
        except BaseException:
            for final in finals:
                with contextlib.suppress(OSError):
                    store.delete(final)
            raise
    return new, finals


def cut_rank(store: RunStore, run: Any, rank: int, manifest: dict, step: int,
             committed: Mapping[str, list]) -> tuple[dict | None, list]:
    """Rank ``rank``'s part of :func:`drop_steps_after` (its lock held by the caller): the manifest keys to
    change (None when the rank has no committed files) and the files to delete once that manifest is written."""

    flushes: dict[Any, list[tuple[str, Any, DataFileName]]] = {}
    for table, files in committed.items():
        for path in files:
            name = parse_data_file(path.name)
            if name is not None and name.rank == rank:
                key = name.flush if name.flush is not None else name.compacted or path  # older: alone
                flushes.setdefault(key, []).append((table, path, name))
    if not flushes:
        return None, []
    records = {tuple(r["flushes"]): r for r in compaction_records(manifest)}
    rows, counts, last_steps = dict.fromkeys(TABLES, 0), no_counts(), []
    gone: list = []
    for key, group in flushes.items():
        paths = [path for _, path, _ in group]
        if isinstance(key, tuple):  # a compacted record's files
            record, written = _cut_record(store, run, rank, records.pop(key, {
                "flushes": list(key), "files": [f"{t}/{p.name}" for t, p, _ in group]}), step)
            if record is None or written:
                gone += paths
            if record is None:
                continue
            records[tuple(record["flushes"])] = record
            paths = [run / rel for rel in record["files"]]
            footers = [read_footer(store, p) for p in paths]
            flush_counts = [counts for _, counts in flush_firsts(footers).values()]
        elif min(name.first_step for _, _, name in group) > step:
            gone += paths
            continue
        else:
            if max(name.last_step for _, _, name in group) > step:
                first = min(name.first_step for _, _, name in group)
                last = max(name.last_step for _, _, name in group)
                raise ResumeError(f"run {manifest.get('run_id')!r} rank {rank}: flush {key} holds steps "
                                  f"{first}-{last}, on both sides of step {step}; it cannot be cut there")
            footers = [read_footer(store, p) for p in paths]
            meta = footers[0].metadata or {}
            flush_counts = [[None if (v := meta.get(f"{FLUSH_META_PREFIX}{k}".encode())) is None else int(v)
                             for k in counts]]
        for values in flush_counts:
            for k, value in zip(list(counts), values, strict=True):
                counts[k] = None if value is None or counts[k] is None else counts[k] + int(value)
        for path, footer in zip(paths, footers, strict=True):
            name = parse_data_file(path.name)
            rows[table_of(path)] += footer.num_rows
            last_steps.append(name.last_step if name is not None else step)
    cut = {COMPACTED_KEY: sorted(records.values(), key=lambda r: r["flushes"][0])} \
        if COMPACTED_KEY in manifest else {}
    return {**counts, **cut, "rows": rows, "updated_at": now(), "publishing": [],
            "last_step": max(last_steps) if last_steps else None}, gone


def no_counts() -> dict[str, int | None]:
    return {"tokens_generated": 0, "tokens_logged": 0, "dropped_rows": 0}


def cut_compacted(run_dir: Path, rank: int, record: dict, step: int, fsync: bool = True) -> tuple[dict | None, list[Path]]:
    """A local compacted record cut back to the flushes whose first step is at most ``step`` (what
    :func:`trustscope.logger.drop_steps_after` keeps of a run): the new record (None when no flush is kept) and
    the files written for it, under new names. A flush's rows are contiguous in a compacted file, so each file
    keeps a prefix of its rows. Nothing is deleted and no manifest written here."""
    paths = [run_dir / rel for rel in record["files"]]
    firsts = flush_firsts([pq.read_metadata(p) for p in paths])
    kept = sorted(f for f, (first, _) in firsts.items() if first <= step)
    if not kept:
        return None, []
    if len(kept) == len(firsts):
        return record, []
    keep = set(kept)
    new = {"flushes": [record["flushes"][0], kept[-1]], "files": [], "at": time.time()}
    written: list[Path] = []
    try:
        for path in paths:
            meta = pq.read_metadata(path)
            originals = json.loads((meta.metadata or {}).get(ORIGINALS_META.encode(), b"[]"))
            taken = [o for o in originals if o[1] in keep]
            if not taken:
                continue
            rows = sum(o[4] for o in taken)
            name = compacted_file_name(rank, min(o[2] for o in taken), max(o[3] for o in taken),
                                         (new["flushes"][0], new["flushes"][1]))
            final = path.parent / name
            tmp = tmp_path(final)
            with pq.ParquetFile(path) as source:
                footer = {k: v for k, v in (meta.metadata or {}).items()
                          if not k.startswith(OWN_META_PREFIXES) and k not in (source.schema_arrow.metadata or {})}
                footer[SOURCES_META.encode()] = json.dumps([[path.name, rows]]).encode()
                footer[ORIGINALS_META.encode()] = json.dumps(taken).encode()
                table = table_of(path)
                left = rows
                with pq.ParquetWriter(tmp, source.schema_arrow, **WRITE_OPTIONS[table].writer_kwargs()) as out:
                    for g in range(source.num_row_groups):
                        if left <= 0:
                            break
                        data = source.read_row_group(g).slice(0, left)
                        out.write_table(data, row_group_size=max(1, data.num_rows))
                        left -= data.num_rows
                    out.add_key_value_metadata(footer)
            replace_file(tmp, final, fsync)
            written.append(final)
            new["files"].append(f"{path.parent.relative_to(run_dir).as_posix()}/{name}")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return new, written
