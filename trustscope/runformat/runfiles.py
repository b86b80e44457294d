"""One rank's writer side of a run (:class:`RunFiles`): the run directory and its lock, the manifests (``run.json``,
``ranks/rank<r>.json``) with the committed flush, the vocab.

The manifest is the commit record of a rank: a flush's files become visible to readers when the manifest that
names its number as ``committed_flush`` replaces the previous one (see :func:`trustscope.runformat.commits.committed_files`).
A run lives on local disk or under an object store prefix; :class:`RunFiles` writes through the
:class:`trustscope.runformat.stores.RunStore` it is given (the status readers and :func:`drop_steps_after` read local runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import __version__
from trustscope.runformat.commits import committed_files, publishing_entries
from trustscope.runformat.cutback import check_resume, cut_rank
from trustscope.runformat.errors import LogDirError, SchemaError
from trustscope.runformat.layout import (
    LAYOUT,
    LAYOUT_KEY,
    MANIFEST,
    SCHEMA_VERSION,
    TABLES,
    TMP_PREFIX,
    TMP_SUFFIX,
    VOCAB_FILE,
    WRITE_OPTIONS,
    is_rank_dir_name,
    layout_of,
    parse_data_file,
    rank_file,
    rank_folder,
    tmp_path,
    with_metadata,
)
from trustscope.runformat.locks import NoLock, RunLock, process_start
from trustscope.runformat.manifest import now, read_json
from trustscope.runformat.recovery import recover_rank
from trustscope.runformat.stores import RunStore

RUN_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def resolve_rank(rank: int | None = None) -> int:
    """The process's rank: ``rank`` if given, else torch.distributed's (when initialised), else ``$RANK``, else 0."""
    if rank is not None:
        return int(rank)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def vocab_texts(vocab: Any) -> list[str]:
    """Token texts indexed by id from a list, a {id: text} dict or a Hugging Face tokenizer."""
    if isinstance(vocab, Mapping):
        size = max(vocab) + 1 if vocab else 0
        texts: list[Any] = [None] * size
        for i, text in vocab.items():
            texts[int(i)] = text
        return texts
    if isinstance(vocab, Sequence) and not isinstance(vocab, str):
        return list(vocab)
    if hasattr(vocab, "decode") and hasattr(vocab, "__len__"):
        return [vocab.decode([i]) for i in range(len(vocab))]
    raise TypeError(f"vocab must be a list of texts, a {{id: text}} dict or a tokenizer, got {type(vocab).__name__}")


class RunFiles:
    """One rank's files of a run: the directory (opened under :class:`RunLock`), the manifest, the vocab.

    ``open`` creates or reopens the run; ``commit`` makes a flush visible; ``finish`` records the final status.
    Every file goes through ``store`` (local disk or an object store prefix).
    """

    def __init__(self, store: RunStore, run_id: str, rank: int):
        self.store, self.run_id, self.rank = store, run_id, rank
        self.logdir = store.logdir
        self.run_dir = store.join(run_id)
        self.path = rank_file(self.run_dir, rank)
        self.lock: RunLock | NoLock = NoLock(store.url) if store.remote else RunLock(self.run_dir, rank)
        self.manifest: dict[str, Any] = {}
        self._manifest_lock = threading.Lock()  # the writer thread saves, the training thread reads
        self._save_lock = threading.Lock()  # the writer and the compaction thread both save
        self.folder_lock = threading.Lock()
        """Held while files are renamed into the rank's folders (the writer) or the folders swapped (compaction)."""
        self.layout = LAYOUT
        """The run's layout (:data:`trustscope.runformat.layout.LAYOUT`): a resumed run keeps its own."""
        self.disk_last_step: int | None = None
        """The last step of this rank in the committed files already on disk (resume), else None."""
        self.next_flush = 1
        self.prior_lost: dict | None = None
        """What earlier sessions of this rank lost (resume); this session's losses are added to it."""
        self.saved_at = time.monotonic()
        """When the manifest was last written (monotonic clock)."""

    # --------------------------------------------------------------------------------------------- opening

    def open(self, resume: bool) -> None:
        """Create the run directory, take the rank's lock, and check or clean what a previous writer left."""
        try:
            self.store.prepare(self.run_dir)
            self.lock.acquire(self.run_id, self.rank)
        except LogDirError:
            raise
        except OSError as err:
            raise LogDirError(f"log directory {self.store.url!r} cannot be written: {err}") from None
        try:
            self._check_existing(resume)
        except BaseException:
            self.lock.release()
            raise

    def data_dir(self, table: str) -> Path | PurePosixPath:
        """Where this rank's files of ``table`` land: its rank folder (layout 2), else the table folder."""
        return (rank_folder(self.run_dir, table, self.rank) if self.layout >= 2
                else self.run_dir / table)

    def _listing(self) -> dict[str, list[str]]:
        """Folder relative to the run -> the names in it, for every table folder and rank folder of the run."""
        out: dict[str, list[str]] = {}
        for table in TABLES:
            names = self.store.names(self.run_dir / table)
            out[table] = [n for n in names if not is_rank_dir_name(n)]
            for n in names:
                if is_rank_dir_name(n):
                    out[f"{table}/{n}"] = self.store.names(self.run_dir / table / n)
        return out

    def _check_existing(self, resume: bool) -> None:
        store = self.store
        if store.exists(self.run_dir / MANIFEST):
            with contextlib.suppress(SchemaError):
                self.layout = layout_of(read_json(self.run_dir / MANIFEST, store))
        if self.layout >= 2:
            for table in TABLES:
                store.prepare_folder(self.data_dir(table))
        listed = self._listing()
        mine = [self.run_dir / f / n for f, names in listed.items() for n in names
                if (name := parse_data_file(n)) is not None and name.rank == self.rank]
        exists = store.exists(self.path) or bool(mine)
        if exists and not resume:
            raise LogDirError(f"run {self.run_id!r} already exists in {store.url!r} (rank {self.rank}); "
                              f"pass resume=True to continue it, or choose another run_id")
        if not exists:
            return

        if store.exists(self.path):  # what a killed writer or compaction of this rank left half done
            recover_rank(store, self.run_dir, self.rank, read_json(self.path, store))
            listed = self._listing()
            mine = [self.run_dir / f / n for f, names in listed.items() for n in names
                    if (name := parse_data_file(n)) is not None and name.rank == self.rank]
        prefix = f"{TMP_PREFIX}r{self.rank:04d}-"
        for folder, names in listed.items():  # half-written files of a writer that died; no reader ever saw them
            for n in names:
                if n.startswith(prefix) and n.endswith(TMP_SUFFIX):
                    store.delete(self.run_dir / folder / n)
        committed = store.committed(self.run_dir) if store.remote else {
            p for files in committed_files(self.run_dir).values() for p in files}
        for path in mine:  # files of a flush whose commit never happened: never visible, and removed now
            if path not in committed:
                store.delete(path)
        kept = [parse_data_file(p.name) for p in mine if p in committed]
        steps = [n.last_step for n in kept if n is not None]
        self.disk_last_step = max(steps) if steps else None
        flushes = [n.flush if n.compacted is None else n.compacted[1] for n in kept
                   if n is not None and (n.flush is not None or n.compacted is not None)]
        self.next_flush = max(flushes, default=0) + 1

    def start_manifest(self, resume: bool, run_info: dict[str, Any], logging_info: dict[str, Any]) -> int | None:
        """Write the manifest of a new or resumed rank; returns the top-K K already logged (resume), else None.

        ``run_info``: what rank 0 records about the run (config, model, loss_rule, ...).
        """
        process = {"pid": os.getpid(), "pid_start": process_start(os.getpid()), "hostname": socket.gethostname()}
        if resume and self.store.exists(self.path):
            old = read_json(self.path, self.store)
            if old.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
                raise SchemaError(f"{self.path}: schema_version {old.get('schema_version')!r}; this trustscope "
                                  f"writes {SCHEMA_VERSION} and cannot append to it")
            topk_k = old.get("logging", {}).get("topk_k")
            declared = (old.get("logging") or {}).get("extra_columns") or {}
            if declared != (logging_info.get("extra_columns") or {}):
                raise SchemaError(f"{self.path}: extra_columns {logging_info.get('extra_columns') or {}} differ from "
                                  f"the run's {declared}: a run's own columns and their types are declared once")
            self.prior_lost = old.get("lost")
            if self.store.remote:  # the earlier sessions' store failures stay counted
                self.store.faults.add_prior(old.get("storage_faults"))
            entry = {"at": now(), **process, "last_step_on_disk": self.disk_last_step,
                     "previous_status": old.get("status")}
            config = run_info.get("config")
            if config is not None and config != old.get("config"):
                entry["config"] = config
            self.next_flush = max(self.next_flush, int(old.get("committed_flush") or 0) + 1)
            self.manifest = {**old, **process, "status": "running", "updated_at": now(), "finished_at": None,
                             "error": None, "logging": {**logging_info, "topk_k": topk_k},
                             "committed_flush": self.next_flush - 1,
                             "resumes": [*old.get("resumes", []), entry]}
            self.manifest.setdefault("tokens_generated", None)  # unknown for files of older loggers
            self.manifest.setdefault("tokens_logged", None)
            self.save()
            return topk_k
        self.manifest = {
            "run_id": self.run_id,
            "schema_version": SCHEMA_VERSION,
            "trustscope_version": __version__,
            "rank": self.rank,
            "world_size": world_size(),
            "status": "running",
            **process,
            "created_at": now(),
            "updated_at": now(),
            "finished_at": None,
            "error": None,
        }
        if self.rank == 0:
            self.manifest.update(run_info)
        self.manifest[LAYOUT_KEY] = self.layout
        self.manifest.update(logging=logging_info, last_step=self.disk_last_step, rows=dict.fromkeys(TABLES, 0),
                             committed_flush=self.next_flush - 1, tokens_generated=0, tokens_logged=0,
                             dropped_rows=0, lost=None, resumes=[])
        self.save()
        return None

    def write_vocab(self, texts: list[Any]) -> None:
        path = self.run_dir / VOCAB_FILE
        table = pa.table({"token_id": pa.array(np.arange(len(texts), dtype=np.int32)), "text": pa.array(texts)},
                         schema=with_metadata("vocab"))
        tmp = tmp_path(self.store.spool(self.run_dir) / VOCAB_FILE)
        pq.write_table(table, tmp, **WRITE_OPTIONS["vocab"].writer_kwargs())
        self.store.publish(tmp, path, fsync=False)

    # ----------------------------------------------------------------------------------------- manifest

    def save(self, **changes: Any) -> None:
        """Update the manifest (``updated_at`` too) and write it atomically; raises the OSError if it fails."""
        with self._save_lock:
            update = {**changes, "updated_at": now()}
            if self.store.remote:  # the store's transient failures so far (FaultLog.report)
                update.setdefault("storage_faults", self.store.faults.report())
            self.store.write_atomic(self.path, json.dumps({**self.manifest, **update}, indent=2, default=str))
            with self._manifest_lock:
                self.manifest.update(update)
            self.saved_at = time.monotonic()

    def note(self, **changes: Any) -> None:
        """Change the manifest in memory only (each value replaced whole); the next save writes it."""
        with self._manifest_lock:
            self.manifest.update(changes)

    def snapshot(self) -> dict:
        """A deep copy of the manifest as last written."""
        with self._manifest_lock:
            return json.loads(json.dumps(self.manifest, default=str))

    def commit(self, flush: int, rows: Mapping[str, int], last_step: int | None, counts: Mapping[str, int],
               topk_k: int | None, lost: dict | None, publishing: Sequence[tuple[Any, Any, int]] = ()) -> None:
        """Commit flushes up to ``flush``: their rows, last step and token counts enter the manifest with
        ``committed_flush = flush``, in one atomic write, before their files are put in place. ``publishing``:
        ``(temporary file, final name, rows)`` of those files, kept in the manifest (``publishing``, paths
        relative to the run) so that the files of a writer killed before it renamed them all are renamed by the
        next writer (:func:`trustscope.runformat.recovery.recover_rank`). Raises the OSError if the manifest cannot
        be written."""
        m = self.manifest
        total = {t: m["rows"].get(t, 0) + rows.get(t, 0) for t in TABLES}
        prev = m.get("last_step")
        step = prev if last_step is None or (prev is not None and prev >= last_step) else last_step
        counted = {k: (m.get(k) or 0) + v if m.get(k) is not None else None for k, v in counts.items()}
        self.save(rows=total, last_step=step, committed_flush=flush, logging={**m["logging"], "topk_k": topk_k},
                  lost=self.all_lost(lost), publishing=[[self._relative(tmp), self._relative(final), n]
                                                        for tmp, final, n in publishing], **counted)

    def _relative(self, path: Any) -> str | None:
        """``path`` relative to the run directory (None for a file outside it: an object store's local spool)."""
        try:
            return PurePosixPath(path).relative_to(PurePosixPath(self.run_dir)).as_posix()
        except ValueError:
            return None

    def cut_after(self, step: int) -> int:
        """Drop this rank's committed flushes after ``step`` (:func:`drop_steps_after` for this rank alone, under
        the lock this logger holds), checked as a resume (:func:`check_resume`); returns how many files went."""
        with self._save_lock:
            check_resume(self.manifest, self.run_id, self.rank, step)
            store = self.store
            committed = committed_files(self.run_dir, fs=store.fs) if store.remote else committed_files(
                self.run_dir)
            changes, gone = cut_rank(store, self.run_dir, self.rank, self.manifest, step, committed)
            if changes is None:
                return 0
            store.write_atomic(self.path, json.dumps({**self.manifest, **changes}, indent=2, default=str))
            with self._manifest_lock:
                self.manifest.update(changes)
            self.saved_at = time.monotonic()
            for path in gone:
                store.delete(path)
            self.disk_last_step = changes["last_step"]
            return len(gone)

    def finish(self, status: str, error: str | None, lost: dict | None) -> None:
        """Mark the rank ``status``; called once the writer thread has ended. The last flush's ``publishing``
        entries whose files are in place go with it (else a finished run would keep naming files "being renamed
        into place" for ever); an entry whose file is not, from a writer that died between commit and rename,
        stays for :func:`trustscope.runformat.recovery.recover_rank` to roll forward or count as lost."""
        landed = [e for e in publishing_entries(self.manifest) if self.store.exists(self.run_dir / e[1])]
        pending = [e for e in self.manifest.get("publishing") or [] if e not in landed]
        self.save(status=status, error=error, finished_at=now(), lost=self.all_lost(lost), publishing=pending)

    def all_lost(self, lost: dict | None) -> dict | None:
        """This session's ``lost`` record added to the earlier sessions' (the manifest's ``lost`` key)."""
        prior = self.prior_lost
        if not prior or not lost:
            return lost or prior
        steps = [v for v in (prior.get("first_step"), prior.get("last_step"), lost["first_step"],
                             lost["last_step"]) if v is not None]
        return {"rows": {t: prior.get("rows", {}).get(t, 0) + lost["rows"].get(t, 0) for t in TABLES},
                "first_step": min(steps, default=None), "last_step": max(steps, default=None),
                "errors": [*prior.get("errors", []), *lost["errors"]][:10]}
