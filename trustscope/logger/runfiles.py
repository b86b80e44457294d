"""Run files and status: the run directory and its lock, the manifests (``run.json``, ``ranks/rank<r>.json``) with
the committed flush, the vocab, and the status readers the dashboard calls (:func:`run_status`, :func:`run_summary`).

The manifest is the commit record of a rank: a flush's files become visible to readers when the manifest that
names its number as ``committed_flush`` replaces the previous one (see :func:`trustscope.schema.committed_files`).
A run lives on local disk or under an object store prefix; :class:`RunFiles` writes through the
:class:`trustscope.storage.RunStore` it is given (the status readers and :func:`drop_steps_after` read local runs).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Container, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import __version__
from trustscope import schema as S
from trustscope.logger.errors import LogDirError, LogWarning
from trustscope.schema import SchemaError
from trustscope.storage import RunStore

RUN_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

STALE_AFTER_FLUSHES = 4
"""A ``running`` rank whose manifest is older than this many ``flush_seconds`` (and :data:`STALE_MIN_S`) reads
``stale``: its writer updates the manifest at least once per ``flush_seconds`` while it lives."""
STALE_MIN_S = 120.0


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks (Linux), to tell a live writer from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return process_start(pid) == start
    return True


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` to a temporary name and rename it over ``path``; on failure no temporary file is left."""
    tmp = S.tmp_path(path)
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the directory may be read-only by now
            tmp.unlink(missing_ok=True)
        raise


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


def rank_file(run_dir: Path | PurePosixPath, rank: int) -> Path:
    """Where rank ``rank`` keeps its status: ``run.json`` for rank 0, ``ranks/rank<r>.json`` for the others."""
    return run_dir / S.MANIFEST if rank == 0 else run_dir / S.RANKS_DIR / f"rank{rank:04d}.json"


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


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (dataclasses and paths included); checked here so close() cannot fail on it."""
    if obj is None:
        return None
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        obj = asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def read_json(path: Path, store: RunStore | None = None) -> dict:
    """The manifest at ``path`` (through ``store``, else from local disk); raises SchemaError naming it."""
    try:
        data = json.loads(store.read_bytes(path) if store is not None else path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: manifest is not a JSON object")
    return data


NO_LOCKS = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK})
"""flock errors of file systems that offer no locks (e.g. Lustre mounted ``noflock``): logging goes on, unlocked."""
INHERITED_LOCK_WAIT_S = 10.0
"""Seconds :meth:`RunLock.acquire` waits for a lock whose owner is gone (no process of its pid on this host) but
that a process it forked still holds (a child between its fork and its exec, a data loader worker): the lock
outlives its owner until that process ends."""


class RunLock:
    """An exclusive lock on ``<run>/.r<rank>.lock`` while a logger writes that rank; the file names the owner.

    An ``flock``: the kernel drops it when its process dies, so the lock of a dead writer is taken over at once.
    The file is removed on release; a lock taken on a file that was removed meanwhile is taken again.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.path = run_dir / f"{S.TMP_PREFIX}r{rank:04d}.lock"
        self._fd: int | None = None

    def acquire(self, run_id: str, rank: int) -> None:
        """Take the lock, or raise LogDirError naming its owner. A lock whose owner is gone but that a process it
        forked still holds (an flock belongs to every copy of the file descriptor) is waited for, up to
        :data:`INHERITED_LOCK_WAIT_S`: a killed logger or compaction leaves it held only that long."""
        deadline = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._owner(fd)
                os.close(fd)
                gone = _owner_gone(owner)
                if gone:
                    deadline = time.monotonic() + INHERITED_LOCK_WAIT_S if deadline is None else deadline
                    if time.monotonic() < deadline:
                        time.sleep(0.01)
                        continue
                raise LogDirError(f"run {run_id!r} rank {rank} is being written by another logger (pid "
                                  f"{owner.get('pid', '?')} on host {owner.get('hostname', '?')}, since "
                                  f"{owner.get('at', '?')}; lock {str(self.path)!r}); close it first, or log "
                                  f"another rank or run_id"
                                  + (f" (pid {owner['pid']} is gone, but a process it started has held its lock "
                                     f"for {INHERITED_LOCK_WAIT_S:g} s)" if gone else "")) from None
            except OSError as err:
                if err.errno not in NO_LOCKS:
                    os.close(fd)
                    raise
                warnings.warn(f"trustscope: {str(self.path)!r} cannot be locked on this file system ({err}); a "
                              f"second logger on run {run_id!r} rank {rank} will not be detected", LogWarning,
                              stacklevel=4)
                break
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its owner released and removed it while we waited for it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(), "at": now()}).encode())
        self._fd = fd

    @staticmethod
    def _owner(fd: int) -> dict:
        try:
            owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # a read-only directory keeps it: the next owner takes it over
                self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _owner_gone(owner: dict) -> bool:
    """Whether the lock owner a lock file names ran on this host and no process of its pid exists now."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid() or owner.get("hostname") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


class NoLock:
    """What an object store run has instead of :class:`RunLock`: S3 offers no lock, so a second logger on the
    same rank is not detected (a warning says so at open)."""

    def __init__(self, url: str):
        self.url = url

    def acquire(self, run_id: str, rank: int) -> None:
        warnings.warn(f"trustscope: object storage has no locks; a second logger on run {run_id!r} rank {rank} "
                      f"under {self.url} will not be detected", LogWarning, stacklevel=4)

    def release(self) -> None:
        pass


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
        self.layout = S.LAYOUT
        """The run's layout (:data:`trustscope.schema.LAYOUT`): a resumed run keeps its own."""
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
        return (S.rank_folder(self.run_dir, table, self.rank) if self.layout >= 2
                else self.run_dir / table)

    def _listing(self) -> dict[str, list[str]]:
        """Folder relative to the run -> the names in it, for every table folder and rank folder of the run."""
        out: dict[str, list[str]] = {}
        for table in S.TABLES:
            names = self.store.names(self.run_dir / table)
            out[table] = [n for n in names if not S.is_rank_dir_name(n)]
            for n in names:
                if S.is_rank_dir_name(n):
                    out[f"{table}/{n}"] = self.store.names(self.run_dir / table / n)
        return out

    def _check_existing(self, resume: bool) -> None:
        store = self.store
        if store.exists(self.run_dir / S.MANIFEST):
            with contextlib.suppress(SchemaError):
                self.layout = S.layout_of(read_json(self.run_dir / S.MANIFEST, store))
        if self.layout >= 2:
            for table in S.TABLES:
                store.prepare_folder(self.data_dir(table))
        listed = self._listing()
        mine = [self.run_dir / f / n for f, names in listed.items() for n in names
                if (name := S.parse_data_file(n)) is not None and name.rank == self.rank]
        exists = store.exists(self.path) or bool(mine)
        if exists and not resume:
            raise LogDirError(f"run {self.run_id!r} already exists in {store.url!r} (rank {self.rank}); "
                              f"pass resume=True to continue it, or choose another run_id")
        if not exists:
            return
        from trustscope.logger.compaction import recover_rank

        if store.exists(self.path):  # what a killed writer or compaction of this rank left half done
            recover_rank(store, self.run_dir, self.rank, read_json(self.path, store))
            listed = self._listing()
            mine = [self.run_dir / f / n for f, names in listed.items() for n in names
                    if (name := S.parse_data_file(n)) is not None and name.rank == self.rank]
        prefix = f"{S.TMP_PREFIX}r{self.rank:04d}-"
        for folder, names in listed.items():  # half-written files of a writer that died; no reader ever saw them
            for n in names:
                if n.startswith(prefix) and n.endswith(S.TMP_SUFFIX):
                    store.delete(self.run_dir / folder / n)
        committed = store.committed(self.run_dir) if store.remote else {
            p for files in S.committed_files(self.run_dir).values() for p in files}
        for path in mine:  # files of a flush whose commit never happened: never visible, and removed now
            if path not in committed:
                store.delete(path)
        kept = [S.parse_data_file(p.name) for p in mine if p in committed]
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
            if old.get("schema_version", S.SCHEMA_VERSION) != S.SCHEMA_VERSION:
                raise SchemaError(f"{self.path}: schema_version {old.get('schema_version')!r}; this trustscope "
                                  f"writes {S.SCHEMA_VERSION} and cannot append to it")
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
            "schema_version": S.SCHEMA_VERSION,
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
        self.manifest[S.LAYOUT_KEY] = self.layout
        self.manifest.update(logging=logging_info, last_step=self.disk_last_step, rows=dict.fromkeys(S.TABLES, 0),
                             committed_flush=self.next_flush - 1, tokens_generated=0, tokens_logged=0,
                             dropped_rows=0, lost=None, resumes=[])
        self.save()
        return None

    def write_vocab(self, texts: list[Any]) -> None:
        path = self.run_dir / S.VOCAB_FILE
        table = pa.table({"token_id": pa.array(np.arange(len(texts), dtype=np.int32)), "text": pa.array(texts)},
                         schema=S.with_metadata("vocab"))
        tmp = S.tmp_path(self.store.spool(self.run_dir) / S.VOCAB_FILE)
        pq.write_table(table, tmp, **S.WRITE_OPTIONS["vocab"].writer_kwargs())
        self.store.publish(tmp, path, fsync=False)

    # ----------------------------------------------------------------------------------------- manifest

    def save(self, **changes: Any) -> None:
        """Update the manifest (``updated_at`` too) and write it atomically; raises the OSError if it fails."""
        with self._save_lock:
            update = {**changes, "updated_at": now()}
            if self.store.remote:  # the store's transient failures so far (storage.FaultLog.report)
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
        next writer (:func:`trustscope.logger.compaction.recover_rank`). Raises the OSError if the manifest cannot
        be written."""
        m = self.manifest
        total = {t: m["rows"].get(t, 0) + rows.get(t, 0) for t in S.TABLES}
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
            committed = S.committed_files(self.run_dir, fs=store.fs) if store.remote else S.committed_files(
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
        stays for :func:`trustscope.logger.compaction.recover_rank` to roll forward or count as lost."""
        landed = [e for e in S.publishing_entries(self.manifest) if self.store.exists(self.run_dir / e[1])]
        pending = [e for e in self.manifest.get("publishing") or [] if e not in landed]
        self.save(status=status, error=error, finished_at=now(), lost=self.all_lost(lost), publishing=pending)

    def all_lost(self, lost: dict | None) -> dict | None:
        """This session's ``lost`` record added to the earlier sessions' (the manifest's ``lost`` key)."""
        prior = self.prior_lost
        if not prior or not lost:
            return lost or prior
        steps = [v for v in (prior.get("first_step"), prior.get("last_step"), lost["first_step"],
                             lost["last_step"]) if v is not None]
        return {"rows": {t: prior.get("rows", {}).get(t, 0) + lost["rows"].get(t, 0) for t in S.TABLES},
                "first_step": min(steps, default=None), "last_step": max(steps, default=None),
                "errors": [*prior.get("errors", []), *lost["errors"]][:10]}


def drop_steps_after(run_dir: str | os.PathLike, step: int, *, ranks: Container[int] | None = None,
                     storage_options: Mapping[str, Any] | None = None, resume: bool = False) -> int:
    """Remove every rank's flushes whose steps all come after ``step`` (a continuation that crashed past its last
    checkpoint) and recount each rank's manifest from the files that remain; returns how many files went.

    ``run_dir`` is a local run folder or an ``s3://`` run prefix (``storage_options`` as for
    :class:`~trustscope.logger.TokenLogger`); ``ranks``: only these ranks (any container, e.g. a ``range``;
    default: every rank with a manifest).
    A flush is removed whole, in every table, so the run keeps whole steps; a flush that holds steps on both sides
    of ``step`` is refused (a logger that commits each step, as the integrations' do, never writes one). Each
    rank's lock is held meanwhile: a rank that a live logger writes is refused (:class:`LogDirError`; object
    storage has no lock). Token counts are rebuilt from the files' footers
    (:data:`trustscope.schema.FLUSH_META_PREFIX`); they become None where a file has none. A compacted file
    (:mod:`trustscope.logger.compaction`) that holds flushes on both sides of ``step`` is written again with the
    kept flushes' rows, and the rank's compaction record changed with it.

    ``resume=True`` (a framework resuming from the checkpoint of ``step``): a rank whose committed steps end before
    ``step`` is refused (:class:`ResumeError`, naming the run, the rank and both steps), since the steps between
    would be missing from the log; so is a rank written by another schema version.
    """
    from trustscope.storage import open_store

    text = str(run_dir).rstrip("/")
    logdir, _, run_id = text.rpartition("/")
    store = open_store(logdir or ".", storage_options)
    try:
        run = store.join(run_id)
        manifests = _store_manifests(store, run)
        if ranks is not None:
            manifests = {r: m for r, m in manifests.items() if r in ranks}
        if resume:
            for rank, manifest in manifests.items():
                check_resume(manifest, run_id, rank, step)
        committed = S.committed_files(run, fs=store.fs) if store.remote else S.committed_files(run)
        removed = 0
        for rank, manifest in manifests.items():
            lock = NoLock(store.url) if store.remote else RunLock(run, rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LogWarning)  # no lock on object storage: said at open already
                lock.acquire(manifest.get("run_id", run_id), rank)
            try:
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


def check_resume(manifest: Mapping[str, Any], run_id: str, rank: int, step: int) -> None:
    """Refuse (:class:`ResumeError`) to resume rank ``rank`` of run ``run_id`` after ``step`` when its manifest
    was written by another schema version, or its committed steps end before ``step`` (the log would miss the
    steps in between: a checkpoint newer than the log)."""
    version = manifest.get("schema_version", S.SCHEMA_VERSION)
    if version != S.SCHEMA_VERSION:
        raise ResumeError(f"run {run_id!r} rank {rank} was written with schema_version {version!r}; this trustscope "
                          f"writes {S.SCHEMA_VERSION} and cannot resume it at step {step}: log the continuation as "
                          f"a new run")
    last = manifest.get("last_step")
    if step >= 0 and (last is None or last < step):
        raise ResumeError(f"cannot resume run {run_id!r} after step {step}: rank {rank} logged only up to step "
                          f"{last} (the checkpoint is newer than the log, so steps {0 if last is None else last + 1}"
                          f"-{step} would be missing); resume from a checkpoint at or before step {last}, or log "
                          f"the continuation as a new run")


def _store_manifests(store: RunStore, run: Path | PurePosixPath) -> dict[int, dict]:
    """Every rank's manifest of the run at ``run``, read through ``store``."""
    paths = [run / S.MANIFEST, *(run / S.RANKS_DIR / n for n in sorted(store.names(run / S.RANKS_DIR))
                                 if n.startswith("rank") and n.endswith(".json"))]
    out = {}
    for path in paths:
        if store.exists(path):
            m = read_json(path, store)
            out[int(m.get("rank", 0))] = m
    if not out:
        raise SchemaError(f"{run}: no run manifest")
    return out


def _cut_record(store: RunStore, run: Any, rank: int, record: dict, step: int) -> tuple[dict | None, list]:
    """:func:`~trustscope.logger.compaction.cut_compacted` through ``store``: an object store's files are cut in
    a local copy and the new files uploaded. Returns the new record (None: nothing kept) and the files written."""
    from trustscope.logger.compaction import ORIGINALS_META, cut_compacted, read_footer

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
    from trustscope.logger.compaction import flush_firsts, read_footer

    flushes: dict[Any, list[tuple[str, Any, S.DataFileName]]] = {}
    for table, files in committed.items():
        for path in files:
            name = S.parse_data_file(path.name)
            if name is not None and name.rank == rank:
                key = name.flush if name.flush is not None else name.compacted or path  # older: alone
                flushes.setdefault(key, []).append((table, path, name))
    if not flushes:
        return None, []
    records = {tuple(r["flushes"]): r for r in S.compaction_records(manifest)}
    rows, counts, last_steps = dict.fromkeys(S.TABLES, 0), _no_counts(), []
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
            flush_counts = [[None if (v := meta.get(f"{S.FLUSH_META_PREFIX}{k}".encode())) is None else int(v)
                             for k in counts]]
        for values in flush_counts:
            for k, value in zip(list(counts), values, strict=True):
                counts[k] = None if value is None or counts[k] is None else counts[k] + int(value)
        for path, footer in zip(paths, footers, strict=True):
            name = S.parse_data_file(path.name)
            rows[S.table_of(path)] += footer.num_rows
            last_steps.append(name.last_step if name is not None else step)
    cut = {S.COMPACTED_KEY: sorted(records.values(), key=lambda r: r["flushes"][0])} \
        if S.COMPACTED_KEY in manifest else {}
    return {**counts, **cut, "rows": rows, "updated_at": now(), "publishing": [],
            "last_step": max(last_steps) if last_steps else None}, gone


def _no_counts() -> dict[str, int | None]:
    return {"tokens_generated": 0, "tokens_logged": 0, "dropped_rows": 0}


# ------------------------------------------------------------------------------------------------------- status


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


def _rank_manifests(run_dir: Path) -> dict[int, dict]:
    out = {}
    for path in S.rank_manifest_paths(run_dir):
        if path.exists():
            m = read_json(path)
            out[int(m.get("rank", 0))] = m
    if not out:
        raise SchemaError(f"{run_dir}: no run manifest")
    return out


def rank_statuses(run_dir: str | os.PathLike) -> dict[int, str]:
    """Effective status of every rank of a run (:func:`effective_status`): running, stale, finished or crashed."""
    at = datetime.now(UTC)
    return {rank: effective_status(m, at) for rank, m in _rank_manifests(Path(run_dir)).items()}


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
    manifests = _rank_manifests(run_dir)
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
        "rows": {t: sum(int(m.get("rows", {}).get(t, 0)) for m in manifests.values()) for t in S.TABLES},
        "last_step": max(last_steps) if last_steps else None,
        "created_at": head.get("created_at"),
        "updated_at": max((m["updated_at"] for m in manifests.values() if m.get("updated_at")), default=None),
        "finished_at": None if None in finished else max(finished),
        "error": errors[0] if errors else None,
        "lost": {rank: m["lost"] for rank, m in sorted(manifests.items()) if m.get("lost")},
    }
