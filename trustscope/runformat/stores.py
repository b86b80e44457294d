"""Where a run's files live: a local directory, or an object store prefix (``s3://bucket/prefix``).

The logger writes through a :class:`RunStore`: :class:`LocalStore` (temporary name, fsync, rename) or
:class:`ObjectStore` (one PUT per object, which S3 makes visible whole or not at all). Either way the manifest that
commits a flush lands first and its files after, one rename or PUT each, so any reader that lists the folders (not
only :func:`trustscope.runformat.commits.committed_files`) finds committed files only. :func:`exchange` swaps two folders in one
atomic step, which compaction uses to replace a rank's folder.

Object stores are reached through pyarrow's filesystem layer over fsspec's ``s3fs``
(``pyarrow.fs.PyFileSystem(FSSpecHandler(s3fs.S3FileSystem(...)))``): the same fsspec filesystem DuckDB can
register, and whose listings carry each object's ETag, which the readers' :func:`mirror` keys its copies by.
Endpoint and credentials come from ``storage_options`` (``s3fs.S3FileSystem`` arguments: ``endpoint_url``,
``key``, ``secret``, ``client_kwargs``, ``config_kwargs``, ...) or from the usual AWS variables and files
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...). Listings are never
cached (``use_listings_cache=False``): a reader must see a flush the moment its commit lands.

A store that fails for a while (``503 SlowDown``, ``500 InternalError``, a connection reset, a stall past the read
timeout) is retried by one layer only, a :class:`Retrier` under a :class:`RetryPolicy` (the store's calls in
:class:`ObjectStore`, the mirror's through :attr:`ObjectStore.fsspec`): exponential backoff with full jitter, a
bounded number of attempts and a deadline per operation. botocore's and s3fs's own retries are turned off unless ``storage_options`` set them, so
the bound stated is the bound there is. Every failed attempt is counted in :attr:`ObjectStore.faults` (the
logger writes it to the rank's manifest as ``storage_faults``) and logged on the ``trustscope.runformat.stores`` logger.

Readers do not query the store in place: :func:`mirror` copies a prefix's committed objects (and the manifests
that commit them) into a local folder, downloading an object again only when its ETag changed, and the query
layer, ``validate`` and the SQL worker read that folder as they read any log directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from trustscope.runformat.commits import LISTING_TRIES, read_commits
from trustscope.runformat.fsops import replace_file
from trustscope.runformat.layout import (
    MANIFEST,
    RANKS_DIR,
    SCHEME,
    TABLES,
    TMP_PREFIX,
    TMP_SUFFIX,
    VOCAB_FILE,
    is_rank_dir_name,
    parse_data_file,
    tmp_path,
)
from trustscope.runformat.retry import (
    _T,
    FAULT_KINDS,
    RETRY_OPTION,
    FaultLog,
    Retrier,
    RetryingFS,
    RetryPolicy,
    StorageError,
    forget_frames,
)

_BUCKET_OK = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_remote(location: Any) -> bool:
    """True for an object store URL (``s3://...``)."""
    return isinstance(location, str) and location.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; raises ValueError naming the URL."""
    if not is_remote(url):
        raise ValueError(f"{url!r} is not an object store URL (expected s3://bucket/prefix)")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not _BUCKET_OK.fullmatch(bucket):
        raise ValueError(f"{url!r}: bucket name {bucket!r} is not a valid S3 bucket name (3-63 characters: "
                         f"lowercase letters, digits, '.', '-')")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{url!r}: prefix {prefix!r} has an empty, '.' or '..' part")
    return bucket, prefix


def s3_filesystem(storage_options: Mapping[str, Any] | None = None,
                  policy: RetryPolicy | None = None) -> Any:
    """An ``s3fs.S3FileSystem`` with ``storage_options``, listings uncached, its own instance.

    With ``policy``, the client makes one attempt per call with the policy's timeouts (botocore
    ``retries={"total_max_attempts": 1}`` and the timeouts, where ``config_kwargs`` does not set them; s3fs's own
    retry loop set to one try), for :class:`ObjectStore` to retry under the policy."""
    import s3fs

    options = {k: v for k, v in (storage_options or {}).items() if k != RETRY_OPTION}
    options.update(use_listings_cache=False, skip_instance_cache=True)
    if policy is not None:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("connect_timeout", policy.connect_timeout_s)
        config.setdefault("read_timeout", policy.read_timeout_s)
        options["config_kwargs"] = config
    fs = s3fs.S3FileSystem(**options)
    if policy is not None:
        fs.retries = 1  # s3fs's class attribute (5 by default): its loop around each call, and each read
    return fs


def check_store(url: str, fsspec_fs: Any, write: bool) -> None:
    """Fail now, naming ``url`` and the cause, when the store cannot be reached, the bucket does not exist or
    (``write``) a tiny object cannot be written and deleted under the prefix. Raises :class:`StorageError`.
    Through a :class:`RetryingFS` a transient failure is retried, except an endpoint nobody answers at."""
    bucket, prefix = parse_url(url)
    try:
        fsspec_fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError as err:
        raise StorageError(f"{url}: bucket {bucket!r} does not exist ({err})") from None
    except PermissionError as err:
        raise StorageError(f"{url}: access to bucket {bucket!r} is denied ({err}); check the credentials "
                           f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options)") from None
    except Exception as err:  # unreachable endpoint, bad TLS, bad region, ...: the cause is in the message
        raise StorageError(f"{url}: the object store cannot be reached: {type(err).__name__}: {err}") from None
    if not write:
        return
    probe = "/".join(p for p in (bucket, prefix, f".probe-{secrets.token_hex(4)}{TMP_SUFFIX}") if p)
    try:
        fsspec_fs.pipe_file(probe, b"")
        fsspec_fs.rm_file(probe)
    except Exception as err:
        raise StorageError(f"{url}: cannot write and delete a test object {SCHEME}{probe}: "
                           f"{type(err).__name__}: {err}") from None


class LocalStore:
    """A run on local disk: files are written under a temporary name, fsynced and renamed into place."""

    remote = False
    fs = None

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = Path(logdir)
        self.url = str(self.logdir)

    def join(self, *parts: str) -> Path:
        return self.logdir.joinpath(*parts)

    def prepare(self, run_dir: Path) -> None:
        """Create the run's folders and check that files can be written there (raises OSError)."""
        for sub in (*TABLES, RANKS_DIR):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".probe-{secrets.token_hex(4)}{TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()

    def prepare_folder(self, folder: Path) -> None:
        """Create ``folder`` (a rank's folder inside a table folder)."""
        Path(folder).mkdir(parents=True, exist_ok=True)

    def write_atomic(self, path: Path, data: str | bytes) -> None:
        """Write ``data`` to a temporary name and rename it over ``path``; on failure no temporary file is left."""
        tmp = tmp_path(path)
        try:
            if isinstance(data, str):
                tmp.write_text(data)
            else:
                tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # the directory may be read-only by now
                tmp.unlink(missing_ok=True)
            raise

    def read_bytes(self, path: Path) -> bytes:
        return Path(path).read_bytes()

    def exists(self, path: Path) -> bool:
        return Path(path).exists()

    def delete(self, path: Path) -> None:
        Path(path).unlink(missing_ok=True)

    def names(self, folder: Path) -> list[str]:
        """The names in ``folder`` (none when it does not exist)."""
        try:
            return [e.name for e in os.scandir(folder)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def spool(self, folder: Path) -> Path:
        """Where the files that will land in ``folder`` are written first: ``folder`` itself."""
        return Path(folder)

    def publish(self, tmp: Path, final: Path, fsync: bool) -> None:
        """Make the finished temporary file ``tmp`` the file ``final`` (an atomic rename)."""
        replace_file(tmp, final, fsync)

    def close(self) -> None:
        pass


class ObjectStore:
    """A run under an object store prefix. Files are encoded into a local spool folder and uploaded whole when a
    flush publishes them: an object is visible in full once its PUT (or multipart upload) completes, never before.
    There is no rename and no lock on S3; objects are written once under their final names."""

    remote = True

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, write: bool = True):
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        self.bucket, prefix = parse_url(url)
        self.url = f"{SCHEME}{self.bucket}" + (f"/{prefix}" if prefix else "")
        self.logdir = PurePosixPath(self.bucket, *prefix.split("/")) if prefix else PurePosixPath(self.bucket)
        self.policy = RetryPolicy.from_options((storage_options or {}).get(RETRY_OPTION))
        """How each operation is retried (``storage_options["trustscope_retry"]``)."""
        self.faults = FaultLog()
        """The transient failures met so far (the rank manifest's ``storage_faults``)."""
        self.retrier = Retrier(self.url, self.policy, self.faults)
        self.retrier.kinds = frozenset(FAULT_KINDS) - {"unreachable"}  # at open: a closed port fails at once
        self.fsspec = RetryingFS(s3_filesystem(storage_options, self.policy), self.retrier)
        """The s3fs file system, each call retried under :attr:`policy` (:class:`RetryingFS`)."""
        self.fs = PyFileSystem(FSSpecHandler(self.fsspec))
        """pyarrow's view of the store (the compaction's listings and reads go through it); the logger's own
        calls and the mirror's go through :attr:`fsspec`."""
        check_store(self.url, self.fsspec, write)
        self.retrier.kinds = frozenset(FAULT_KINDS)
        self._spool = Path(tempfile.mkdtemp(prefix="trustscope-spool-")) if write else None

    def join(self, *parts: str) -> PurePosixPath:
        return self.logdir.joinpath(*parts)

    def url_of(self, path: PurePosixPath | str) -> str:
        return f"{SCHEME}{path}"

    def prepare(self, run_dir: PurePosixPath) -> None:
        """Nothing to create on an object store (prefixes are implicit); the open-time check already wrote."""

    def prepare_folder(self, folder: PurePosixPath) -> None:
        """Nothing to create: prefixes are implicit."""

    def retry(self, what: str, target: str, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``call(*args, **kwargs)`` retried under :attr:`policy` (:meth:`Retrier.retry`)."""
        return self.retrier.retry(what, target, call, *args, **kwargs)

    @contextlib.contextmanager
    def _failing(self, what: str, path: PurePosixPath) -> Iterator[None]:
        """Any error of the store's client (botocore's are not OSErrors) as a :class:`StorageError` naming the
        object, so every caller that handles OSError handles the store's failures too."""
        try:
            yield
        except (FileNotFoundError, StorageError):
            raise
        except Exception as err:
            raise StorageError(f"cannot {what} {self.url_of(path)}: {type(err).__name__}: {err}") from err

    def write_atomic(self, path: PurePosixPath, data: str | bytes) -> None:
        """One PUT: readers see the old object or the new one, whole."""
        with self._failing("write", path):
            self.fsspec.pipe_file(str(path), data.encode() if isinstance(data, str) else data)

    def read_bytes(self, path: PurePosixPath) -> bytes:
        with self._failing("read", path):
            return self.fsspec.cat_file(str(path))

    def exists(self, path: PurePosixPath) -> bool:
        """Whether the object exists; a store that fails past the retry bound raises (never a False that is not
        known to be so)."""
        with self._failing("look up", path):
            try:
                return self.fsspec.info(str(path)).get("type") == "file"
            except FileNotFoundError as err:
                forget_frames(err)
                return False

    def delete(self, path: PurePosixPath) -> None:
        with contextlib.suppress(FileNotFoundError), self._failing("delete", path):
            self.fsspec.rm_file(str(path))

    def names(self, folder: PurePosixPath) -> list[str]:
        """The names directly in ``folder`` (none when it does not exist); a failing store raises."""
        with self._failing("list", folder):
            return list(object_listing(self.fsspec, str(folder)))

    def spool(self, folder: PurePosixPath) -> Path:
        """The local folder a table's files are encoded in before their upload."""
        assert self._spool is not None, "a read-only ObjectStore writes nothing"
        local = self._spool / folder.name
        local.mkdir(exist_ok=True)
        return local

    def publish(self, tmp: Path, final: PurePosixPath, fsync: bool) -> None:
        """Upload the finished local file ``tmp`` as the object ``final``, then remove ``tmp``. ``fsync`` is moot:
        the store has the object once this returns.

        Through s3fs's ``put_file``, not a pyarrow output stream: a stream is completed by its close even after a
        failed write (a truncated object would appear), while ``put_file`` is one PUT, or a multipart upload (parts
        sent concurrently) that it aborts on any failure, so the object appears whole or not at all."""
        with self._failing("upload", final):
            self.fsspec.put_file(str(tmp), str(final))
        tmp.unlink()

    def committed(self, run_dir: PurePosixPath) -> set[PurePosixPath]:
        """The data objects of the run at ``run_dir`` that its manifests commit (the same view the mirror
        copies); a failing store raises, so no caller takes a committed object for an uncommitted one."""
        with self._failing("list", run_dir):
            _, objects = committed_objects(self.fsspec, str(run_dir))
        return {run_dir / rel for rel in objects if rel != VOCAB_FILE}

    def close(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)


RunStore = LocalStore | ObjectStore


def open_store(logdir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> RunStore:
    """The store the logger writes ``logdir`` through: an :class:`ObjectStore` for ``s3://`` URLs (checked now:
    reachable, bucket present, writable), else a :class:`LocalStore`."""
    if is_remote(logdir):
        return ObjectStore(str(logdir), storage_options)
    if storage_options:
        raise ValueError(f"storage_options are for s3:// log directories; {str(logdir)!r} is a local path")
    return LocalStore(logdir)


def object_listing(fsspec_fs: Any, folder: str) -> dict[str, dict]:
    """name -> listing entry (``type``; objects also ``ETag``, ``size``) of what lies directly in ``folder``."""
    try:
        entries = fsspec_fs.ls(folder, detail=True)
    except FileNotFoundError as err:
        forget_frames(err)
        return {}
    return {PurePosixPath(e["name"]).name: e for e in entries}


def remote_runs(fsspec_fs: Any, top: str) -> list[str]:
    """The run prefixes under ``top``: ``top`` itself when it holds a run.json, else its children that hold one
    or a table folder (as :func:`trustscope.runformat.validation.run_dirs`)."""
    entries = object_listing(fsspec_fs, top)
    if MANIFEST in entries:
        return [top]
    runs = []
    for name, entry in sorted(entries.items()):
        if entry.get("type") == "directory" and not name.startswith(TMP_PREFIX):
            inside = object_listing(fsspec_fs, f"{top}/{name}")
            if MANIFEST in inside or any(inside.get(t, {}).get("type") == "directory" for t in TABLES):
                runs.append(f"{top}/{name}")
    return runs


def run_objects(fsspec_fs: Any, run: str) -> dict[str, dict]:
    """Every object of a run, by its path inside the run (``tokens/r0000-...parquet``, ``run.json``, ...): one
    paginated listing of the whole prefix."""
    found = fsspec_fs.find(run, detail=True)
    return {key[len(run) + 1:]: entry for key, entry in found.items() if entry.get("type") == "file"}


def _manifest_rank(rel: str) -> int | None:
    """The rank whose manifest lies at ``rel`` inside a run (``run.json``: 0, ``ranks/rank0003.json``: 3)."""
    if rel == MANIFEST:
        return 0
    m = re.fullmatch(rf"{RANKS_DIR}/rank(\d+)\.json", rel)
    return int(m[1]) if m else None


def committed_objects(fsspec_fs: Any, run: str) -> tuple[dict[str, bytes], dict[str, dict]]:
    """A consistent view of one run: (its manifests' bytes, the objects those manifests commit), by path inside
    the run. The manifests are read first and the objects listed after, so every object a manifest commits is
    in the listing (a flush's parts land before its commit). Data files of a rank whose manifest appeared after
    the manifests were read are left out: nothing read commits them. A compaction deletes the objects it
    supersedes only after its commit, so the manifests are read again after the listing, and the run listed again
    when a compaction committed meanwhile (see :func:`trustscope.runformat.commits.committed_files`)."""

    def read_manifests(listed: dict[str, dict]) -> dict[str, bytes]:
        manifests = {}
        for rel in [rel for rel in listed if _manifest_rank(rel) is not None]:
            with contextlib.suppress(FileNotFoundError):
                manifests[rel] = fsspec_fs.cat_file(f"{run}/{rel}")
        return manifests

    manifests = read_manifests(run_objects(fsspec_fs, run))
    for _ in range(LISTING_TRIES):
        commits = read_commits(manifests.values())
        listed = run_objects(fsspec_fs, run)
        read = {_manifest_rank(rel) for rel in manifests}
        late = {rank for rel in listed if (rank := _manifest_rank(rel)) is not None} - read
        objects = {rel: entry for rel, entry in listed.items() if rel == VOCAB_FILE}
        folders: dict[str, list[str]] = {}
        for rel in listed:
            folder, _, name = rel.rpartition("/")
            parts = folder.split("/")
            if parts[0] in TABLES and (len(parts) == 1 or (len(parts) == 2 and is_rank_dir_name(parts[1]))):
                folders.setdefault(folder, []).append(name)
        present = {f"{folder}/{n}" for folder, names in folders.items() for n in names}
        for folder, names in folders.items():
            for name in commits.select(folder, names, present):
                parsed = parse_data_file(name)
                if parsed is None or parsed.rank not in late:
                    objects[f"{folder}/{name}"] = listed[f"{folder}/{name}"]
        again = read_manifests({rel: {} for rel in manifests})
        now = read_commits(again.values())
        if (now.ranges, now.listed) == (commits.ranges, commits.listed):
            break
        manifests = again
    return manifests, objects


def where(store: RunStore, path: Any) -> str:
    return store.url_of(path) if store.remote else str(path)
