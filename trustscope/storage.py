"""Where a run's files live: a local directory, or an object store prefix (``s3://bucket/prefix``).

The logger writes through a :class:`RunStore`: :class:`LocalStore` (temporary name, fsync, rename) or
:class:`ObjectStore` (one PUT per object, which S3 makes visible whole or not at all). Either way the manifest that
commits a flush lands first and its files after, one rename or PUT each, so any reader that lists the folders (not
only :func:`trustscope.schema.committed_files`) finds committed files only. :func:`exchange` swaps two folders in one
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
logger writes it to the rank's manifest as ``storage_faults``) and logged on the ``trustscope.storage`` logger.

Readers do not query the store in place: :func:`mirror` copies a prefix's committed objects (and the manifests
that commit them) into a local folder, downloading an object again only when its ETag changed, and the query
layer, ``validate`` and the SQL worker read that folder as they read any log directory.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from trustscope import schema as S

SCHEME = "s3://"
_BUCKET_OK = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
RETRY_OPTION = "trustscope_retry"
"""The ``storage_options`` key of the retry policy (a dict of :class:`RetryPolicy` fields); not passed to s3fs."""
log = logging.getLogger("trustscope.storage")
_T = TypeVar("_T")


class StorageError(OSError):
    """An object store that cannot be used: the message names the URL and the cause."""


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


@dataclass(frozen=True)
class RetryPolicy:
    """How an object store operation (one upload, manifest write, listing, read or delete) is retried when the
    store fails transiently (:func:`fault_kind`).

    Failure ``n`` waits ``uniform(0, min(cap_s, base_s * 2**(n-1)))`` seconds (exponential backoff, full jitter)
    before the next attempt. No attempt starts after ``attempts`` attempts or once ``deadline_s`` seconds have
    passed since the first: an operation then fails with :class:`StorageError`. An attempt itself is bounded by the
    client's timeouts (``connect_timeout_s`` to connect, ``read_timeout_s`` per read of the answer), so a store that
    stalls costs an operation at most :attr:`bound_s`. Set through ``storage_options={"trustscope_retry": {...}}``.
    """

    attempts: int = 8
    """Attempts per operation, the first included."""
    base_s: float = 0.25
    """The backoff's first ceiling; it doubles with each failure."""
    cap_s: float = 8.0
    """The largest ceiling of one wait."""
    deadline_s: float = 60.0
    """No new attempt starts this many seconds after the first."""
    connect_timeout_s: float = 10.0
    """botocore's ``connect_timeout`` (unless ``config_kwargs`` sets it)."""
    read_timeout_s: float = 20.0
    """botocore's ``read_timeout``: a reply that sends nothing this long is a failed attempt."""

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"{RETRY_OPTION}.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("base_s", "cap_s", "deadline_s", "connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{RETRY_OPTION}.{name} must be a finite number of seconds > 0, got {value!r}")

    @classmethod
    def from_options(cls, value: Any) -> RetryPolicy:
        """The policy a ``storage_options["trustscope_retry"]`` value asks for (None: the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, RetryPolicy):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{RETRY_OPTION} must be a dict of {list(cls.__dataclass_fields__)}, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{RETRY_OPTION}: unknown field(s) {unknown}; the fields are "
                             f"{list(cls.__dataclass_fields__)}")
        return cls(**value)

    def wait_s(self, failure: int, rng: random.Random) -> float:
        """The wait after failure number ``failure`` (1 for the first)."""
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0 ** (failure - 1)))

    @property
    def bound_s(self) -> float:
        """The most one operation takes when every attempt stalls: the deadline, plus one attempt begun just
        before it that waits the connect and read timeouts out."""
        return self.deadline_s + self.connect_timeout_s + self.read_timeout_s


_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "ServiceUnavailable",
              "TooManyRequestsException", "RequestThrottled", "503", "429"}
_SERVER = {"InternalError", "InternalServerError", "500", "502", "504", "BadGateway", "GatewayTimeout"}
_TIMEOUT_CODES = {"RequestTimeout", "RequestTimeoutException"}
_RESET_NAMES = {"ConnectionClosedError", "ServerDisconnectedError", "ClientPayloadError", "IncompleteRead",
                "ResponseParserError", "ClientOSError", "ContentLengthError", "TransferEncodingError",
                "BadStatusLine"}
_TIMEOUT_NAMES = {"ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError", "FSTimeoutError",
                  "TimeoutError", "SocketTimeoutError", "ConnectionTimeoutError"}
_UNREACHABLE_NAMES = {"ClientConnectorError", "ConnectionRefusedError"}
_WRAPPER_NAMES = {"EndpointConnectionError", "HTTPClientError"}
"""botocore's wrappers of the HTTP client's error: aiobotocore raises EndpointConnectionError for a connection
that could not be made and for one reset midway alike; the error wrapped tells them apart."""
FAULT_KINDS = ("throttled", "server", "reset", "timeout", "unreachable")
"""The transient failures :func:`fault_kind` tells apart; every one is retried during logging and reading."""


def fault_kind(err: BaseException) -> str | None:
    """The kind of transient failure ``err`` is (one of :data:`FAULT_KINDS`), or None for an error that trying
    again will not cure (missing object or bucket, denied access, bad request). Follows the exception's causes:
    s3fs turns botocore's errors into OSErrors that keep the original as their cause, and botocore wraps the HTTP
    client's errors."""
    seen: set[int] = set()
    chain: BaseException | None = err
    fallback = None
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        response = getattr(chain, "response", None)
        if isinstance(response, Mapping):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
            if code in _THROTTLED or status in ("503", "429"):
                return "throttled"
            if code in _SERVER or status in ("500", "502", "504"):
                return "server"
            if code in _TIMEOUT_CODES:
                return "timeout"
            return None
        name = type(chain).__name__
        if name in _UNREACHABLE_NAMES or isinstance(chain, ConnectionRefusedError):
            return "unreachable"
        if name in _TIMEOUT_NAMES or isinstance(chain, TimeoutError):  # asyncio's and socket's are aliases
            return "timeout"
        if name in _RESET_NAMES or isinstance(chain, ConnectionError):
            return "reset"
        if name in _WRAPPER_NAMES:
            fallback = fallback or ("unreachable" if name == "EndpointConnectionError" else "reset")
            wrapped = (getattr(chain, "kwargs", None) or {}).get("error")
            if isinstance(wrapped, BaseException) and id(wrapped) not in seen:
                chain = wrapped
                continue
        elif "SlowDown" in str(chain) or "reduce your request rate" in str(chain):
            return "throttled"
        chain = chain.__cause__ or chain.__context__
    return fallback


class FaultLog:
    """The transient failures of one store, counted (thread-safe: the writer and compaction threads share it).
    :meth:`report` is what the rank's manifest records as ``storage_faults``."""

    def __init__(self, prior: Mapping[str, Any] | None = None):
        self._lock = threading.Lock()
        prior = prior if isinstance(prior, Mapping) else {}
        self.failures = int(prior.get("failures", 0) or 0)
        self.gave_up = int(prior.get("gave_up", 0) or 0)
        self.kinds: Counter = Counter(prior.get("kinds") or {})
        self.operations: Counter = Counter(prior.get("operations") or {})
        self.last: dict[str, Any] | None = prior.get("last") if isinstance(prior.get("last"), dict) else None

    def add_prior(self, prior: Mapping[str, Any] | None) -> None:
        """Add an earlier session's record (a resumed rank keeps counting)."""
        if not isinstance(prior, Mapping):
            return
        with self._lock:
            self.failures += int(prior.get("failures", 0) or 0)
            self.gave_up += int(prior.get("gave_up", 0) or 0)
            self.kinds.update(prior.get("kinds") or {})
            self.operations.update(prior.get("operations") or {})
            if self.last is None and isinstance(prior.get("last"), dict):
                self.last = dict(prior["last"])

    def record(self, operation: str, url: str, kind: str, err: BaseException, attempt: int, gave_up: bool) -> None:
        with self._lock:
            self.failures += 1
            self.gave_up += int(gave_up)
            self.kinds[kind] += 1
            self.operations[operation] += 1
            self.last = {"at": datetime.now(UTC).isoformat(timespec="milliseconds"), "operation": operation,
                         "object": url, "kind": kind, "attempt": attempt, "gave_up": gave_up,
                         "error": f"{type(err).__name__}: {err}"[:500]}

    def report(self) -> dict[str, Any]:
        """``failures`` (failed attempts), ``gave_up`` (operations that failed past the retry bound), ``kinds``
        and ``operations`` (failed attempts by kind and by operation), ``last`` (the latest failure)."""
        with self._lock:
            return {"failures": self.failures, "gave_up": self.gave_up, "kinds": dict(self.kinds),
                    "operations": dict(self.operations), "last": None if self.last is None else dict(self.last)}


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


_VERBS = {"ls": "list", "find": "list", "info": "look up", "isdir": "look up", "isfile": "look up",
          "cat_file": "read", "get_file": "download", "put_file": "upload", "pipe_file": "write",
          "rm_file": "delete", "rm": "delete", "call_s3": "call"}


class Retrier:
    """Calls retried under a :class:`RetryPolicy`, their failures counted in a :class:`FaultLog` and logged.
    Holds no reference to the store it serves (no reference cycle keeps a closed store's client alive)."""

    def __init__(self, url: str, policy: RetryPolicy, faults: FaultLog):
        self.url, self.policy, self.faults = url, policy, faults
        self.kinds: frozenset[str] = frozenset(FAULT_KINDS)
        """The kinds retried (:data:`FAULT_KINDS`; an open leaves ``unreachable`` out)."""
        self._rng = random.Random()

    def retry(self, what: str, target: str, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``call(*args, **kwargs)``, tried again under :attr:`policy` while it fails transiently
        (:func:`fault_kind`). Each failure is counted in :attr:`faults` and logged; past the bound a
        :class:`StorageError` names the object, the kind, the attempts and the last error. Other errors, and
        FileNotFoundError, are raised at once."""
        policy, start, failure = self.policy, time.monotonic(), 0
        while True:
            try:
                return call(*args, **kwargs)
            except (FileNotFoundError, StorageError):
                raise
            except Exception as err:
                kind = fault_kind(err)
                if kind is None or kind not in self.kinds:
                    raise
                failure += 1
                elapsed = time.monotonic() - start
                wait = policy.wait_s(failure, self._rng)
                last = failure >= policy.attempts or elapsed + wait >= policy.deadline_s
                url = f"{SCHEME}{target}" if target else self.url
                self.faults.record(what, url, kind, err, failure, last)
                if last:
                    log.error("trustscope: cannot %s %s: %s, %d attempt(s) in %.1f s, giving up: %s: %s",
                              what, url, kind, failure, elapsed, type(err).__name__, err)
                    raise StorageError(f"cannot {what} {url}: the store failed {failure} time(s) in {elapsed:.1f} s "
                                       f"(retry bound: {policy.attempts} attempts, {policy.deadline_s:g} s), last "
                                       f"{kind}: {type(err).__name__}: {err}") from err
                log.warning("trustscope: %s %s failed (%s, attempt %d of %d), retrying in %.2f s: %s: %s",
                            what, url, kind, failure, policy.attempts, wait, type(err).__name__, err)
                _forget(err)  # retried: its frames need not outlive it
                time.sleep(wait)


class RetryingFS:
    """An s3fs file system whose calls in :data:`_VERBS` are each retried by a :class:`Retrier`; other
    attributes are the file system's own."""

    def __init__(self, fs: Any, retrier: Retrier):
        self._fs, self._retrier = fs, retrier

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        verb = _VERBS.get(name)
        if verb is None or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            target = str(args[1] if name == "put_file" else args[0]) if args else ""  # put_file(local, remote)
            return self._retrier.retry(verb, target, attr, *args, **kwargs)

        return call


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
    probe = "/".join(p for p in (bucket, prefix, f".probe-{secrets.token_hex(4)}{S.TMP_SUFFIX}") if p)
    try:
        fsspec_fs.pipe_file(probe, b"")
        fsspec_fs.rm_file(probe)
    except Exception as err:
        raise StorageError(f"{url}: cannot write and delete a test object {SCHEME}{probe}: "
                           f"{type(err).__name__}: {err}") from None


def fsync_file(path: str | os.PathLike) -> None:
    """Put the local file ``path``'s bytes on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: str | os.PathLike, final: str | os.PathLike, fsync: bool) -> None:
    """Rename the finished local file ``tmp`` to ``final`` atomically, its bytes on disk first when ``fsync``."""
    if fsync:
        fsync_file(tmp)
    os.replace(tmp, final)


RENAME_EXCHANGE = 2
"""``renameat2``'s flag that swaps two existing paths in one atomic step (Linux 3.15; ext4, xfs, btrfs, tmpfs)."""
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV}
_exchange_ok: dict[int, bool] = {}


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, looked up once, from the symbols the process has loaded already. Never through
    ``ctypes.util.find_library``: it runs ``ldconfig -p`` in a child process, which holds a copy of every open
    file (a rank's lock among them) until it execs, so a process killed in that moment leaves its lock held by
    a process that is not itself, for a while after it is gone; and it costs milliseconds a swap."""
    import ctypes

    for name in (None, "libc.so.6"):
        try:
            fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap the two existing paths ``a`` and ``b`` (folders here) in one atomic step: a reader resolving either
    name finds the old entry or the new one, never neither (Linux ``renameat2(RENAME_EXCHANGE)`` through libc).
    Raises OSError (EINVAL, ENOSYS, ...) where the system or file system cannot (see :func:`can_exchange`)."""
    import ctypes

    fn = _renameat2() if sys.platform.startswith("linux") else None
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2(RENAME_EXCHANGE) is not available on this system")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def can_exchange(folder: str | os.PathLike) -> bool:
    """Whether :func:`exchange` works inside ``folder`` (tried once per file system on two empty folders made
    there; NFS and non-Linux systems cannot)."""
    folder = Path(folder)
    try:
        dev = folder.stat().st_dev
    except OSError:
        return False
    if dev not in _exchange_ok:
        probe = folder / f".exchange-{secrets.token_hex(4)}{S.TMP_SUFFIX}"
        try:
            (probe / "a").mkdir(parents=True)
            (probe / "b").mkdir()
            exchange(probe / "a", probe / "b")
            _exchange_ok[dev] = True
        except OSError as err:
            if err.errno not in _NO_EXCHANGE:
                return False  # the folder cannot be written: nothing to swap here (the file system is not judged)
            _exchange_ok[dev] = False
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    return _exchange_ok[dev]


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
        for sub in (*S.TABLES, S.RANKS_DIR):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".probe-{secrets.token_hex(4)}{S.TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()

    def prepare_folder(self, folder: Path) -> None:
        """Create ``folder`` (a rank's folder inside a table folder)."""
        Path(folder).mkdir(parents=True, exist_ok=True)

    def write_atomic(self, path: Path, data: str | bytes) -> None:
        """Write ``data`` to a temporary name and rename it over ``path``; on failure no temporary file is left."""
        tmp = S.tmp_path(path)
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
                _forget(err)
                return False

    def delete(self, path: PurePosixPath) -> None:
        with contextlib.suppress(FileNotFoundError), self._failing("delete", path):
            self.fsspec.rm_file(str(path))

    def names(self, folder: PurePosixPath) -> list[str]:
        """The names directly in ``folder`` (none when it does not exist); a failing store raises."""
        with self._failing("list", folder):
            return list(_listing(self.fsspec, str(folder)))

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
            _, objects = _committed_objects(self.fsspec, str(run_dir))
        return {run_dir / rel for rel in objects if rel != S.VOCAB_FILE}

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


# ------------------------------------------------------------------------------------------------ the mirror

INDEX = ".trustscope-mirror.json"
"""The mirror's record of what it holds: relative path -> the ETag of the object it was copied from."""
MANIFEST_TAG = "manifest"
"""The index's mark for a manifest: manifests are copied at every update (they change at every commit)."""


def default_mirror_root() -> Path:
    """Where mirrors of object store prefixes are kept: ``s3/`` under :func:`trustscope.paths.cache_root`."""
    from trustscope.paths import cache_root

    return cache_root() / "s3"


def mirror_dir(url: str, root: Path) -> Path:
    """The local folder that mirrors ``url``: ``<root>/<hash of the URL>/<last part of the URL>``, so a run's
    folder keeps its run id as its name."""
    bucket, prefix = parse_url(url)
    canonical = f"{SCHEME}{bucket}" + (f"/{prefix}" if prefix else "")
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return Path(root) / digest / (prefix.rsplit("/", 1)[-1] if prefix else bucket)


def _listing(fsspec_fs: Any, folder: str) -> dict[str, dict]:
    """name -> listing entry (``type``; objects also ``ETag``, ``size``) of what lies directly in ``folder``."""
    try:
        entries = fsspec_fs.ls(folder, detail=True)
    except FileNotFoundError as err:
        _forget(err)
        return {}
    return {PurePosixPath(e["name"]).name: e for e in entries}


def _forget(err: BaseException) -> None:
    """Drop the traceback of an expected error (a missing object): its frames, s3fs's coroutines among them, would
    keep the file system and its client alive after the store is closed."""
    seen: set[int] = set()
    chain: BaseException | None = err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        chain.__traceback__ = None
        chain = chain.__cause__ or chain.__context__


def _remote_runs(fsspec_fs: Any, top: str) -> list[str]:
    """The run prefixes under ``top``: ``top`` itself when it holds a run.json, else its children that hold one
    or a table folder (as :func:`trustscope.schema.run_dirs`)."""
    entries = _listing(fsspec_fs, top)
    if S.MANIFEST in entries:
        return [top]
    runs = []
    for name, entry in sorted(entries.items()):
        if entry.get("type") == "directory" and not name.startswith(S.TMP_PREFIX):
            inside = _listing(fsspec_fs, f"{top}/{name}")
            if S.MANIFEST in inside or any(inside.get(t, {}).get("type") == "directory" for t in S.TABLES):
                runs.append(f"{top}/{name}")
    return runs


def _run_objects(fsspec_fs: Any, run: str) -> dict[str, dict]:
    """Every object of a run, by its path inside the run (``tokens/r0000-...parquet``, ``run.json``, ...): one
    paginated listing of the whole prefix."""
    found = fsspec_fs.find(run, detail=True)
    return {key[len(run) + 1:]: entry for key, entry in found.items() if entry.get("type") == "file"}


def _manifest_rank(rel: str) -> int | None:
    """The rank whose manifest lies at ``rel`` inside a run (``run.json``: 0, ``ranks/rank0003.json``: 3)."""
    if rel == S.MANIFEST:
        return 0
    m = re.fullmatch(rf"{S.RANKS_DIR}/rank(\d+)\.json", rel)
    return int(m[1]) if m else None


def _committed_objects(fsspec_fs: Any, run: str) -> tuple[dict[str, bytes], dict[str, dict]]:
    """A consistent view of one run: (its manifests' bytes, the objects those manifests commit), by path inside
    the run. The manifests are read first and the objects listed after, so every object a manifest commits is
    in the listing (a flush's parts land before its commit). Data files of a rank whose manifest appeared after
    the manifests were read are left out: nothing read commits them. A compaction deletes the objects it
    supersedes only after its commit, so the manifests are read again after the listing, and the run listed again
    when a compaction committed meanwhile (see :func:`trustscope.schema.committed_files`)."""

    def read_manifests(listed: dict[str, dict]) -> dict[str, bytes]:
        manifests = {}
        for rel in [rel for rel in listed if _manifest_rank(rel) is not None]:
            with contextlib.suppress(FileNotFoundError):
                manifests[rel] = fsspec_fs.cat_file(f"{run}/{rel}")
        return manifests

    manifests = read_manifests(_run_objects(fsspec_fs, run))
    for _ in range(S.LISTING_TRIES):
        commits = S.read_commits(manifests.values())
        listed = _run_objects(fsspec_fs, run)
        read = {_manifest_rank(rel) for rel in manifests}
        late = {rank for rel in listed if (rank := _manifest_rank(rel)) is not None} - read
        objects = {rel: entry for rel, entry in listed.items() if rel == S.VOCAB_FILE}
        folders: dict[str, list[str]] = {}
        for rel in listed:
            folder, _, name = rel.rpartition("/")
            parts = folder.split("/")
            if parts[0] in S.TABLES and (len(parts) == 1 or (len(parts) == 2 and S.is_rank_dir_name(parts[1]))):
                folders.setdefault(folder, []).append(name)
        present = {f"{folder}/{n}" for folder, names in folders.items() for n in names}
        for folder, names in folders.items():
            for name in commits.select(folder, names, present):
                parsed = S.parse_data_file(name)
                if parsed is None or parsed.rank not in late:
                    objects[f"{folder}/{name}"] = listed[f"{folder}/{name}"]
        again = read_manifests({rel: {} for rel in manifests})
        now = S.read_commits(again.values())
        if (now.ranges, now.listed) == (commits.ranges, commits.listed):
            break
        manifests = again
    return manifests, objects


def stray_objects(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The URLs of the ``.parquet`` objects under the table prefixes of each run under ``url`` that no manifest
    commits: what a plain reader of the prefix reads and trustscope does not (``trustscope validate`` names them;
    ``trustscope compact`` removes those provably superseded or orphaned). Raises :class:`StorageError`."""
    store = ObjectStore(url, storage_options, write=False)
    try:
        fs, out = store.fsspec, []
        for run in _remote_runs(fs, str(store.logdir)):
            _, committed = _committed_objects(fs, run)
            out += [f"{SCHEME}{run}/{rel}" for rel in sorted(_run_objects(fs, run))
                    if rel.split("/")[0] in S.TABLES and rel.endswith(".parquet") and rel not in committed]
        return out
    except StorageError:
        raise
    except Exception as err:
        raise StorageError(f"{store.url}: cannot list the object store: {type(err).__name__}: {err}") from None
    finally:
        store.close()


def mirror(url: str, root: Path | None = None, storage_options: Mapping[str, Any] | None = None,
           store: ObjectStore | None = None) -> Path:
    """Bring the local mirror of ``url`` up to date and return its folder (see :func:`mirror_dir`).

    For each run: read every rank's manifest, list the run's objects (one paginated listing), download the
    objects whose flush those manifests commit (again only when the ETag changed), write the manifests, and only
    then remove local files whose object is gone or no longer visible; so the mirror too never shows a flush
    without its commit or a commit without its files. Raises :class:`StorageError` naming the URL when the store
    cannot be read.
    """
    store = store or ObjectStore(url, storage_options, write=False)
    local_top = mirror_dir(store.url, root or default_mirror_root())
    index_path = local_top / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    fs, top = store.fsspec, str(store.logdir)
    wanted: dict[str, str] = {}  # path inside the mirror -> ETag
    manifests: dict[str, bytes] = {}
    try:
        for run in _remote_runs(fs, top):
            inside = run[len(top):].strip("/")
            run_manifests, run_objects = _committed_objects(fs, run)
            manifests.update({str(PurePosixPath(inside, rel)): data for rel, data in run_manifests.items()})
            for rel, entry in run_objects.items():
                local_rel, etag = str(PurePosixPath(inside, rel)), entry.get("ETag", "")
                wanted[local_rel] = etag
                local = local_top / local_rel
                if etag and index.get(local_rel) == etag and local.is_file():
                    continue
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = S.tmp_path(local)
                fs.get_file(entry["name"], str(tmp))
                os.replace(tmp, local)
                index[local_rel] = etag
    except StorageError:
        raise
    except Exception as err:
        raise StorageError(f"{store.url}: cannot read the object store: {type(err).__name__}: {err}") from None
    disk = LocalStore(local_top)
    for rel, data in manifests.items():
        (local_top / rel).parent.mkdir(parents=True, exist_ok=True)
        disk.write_atomic(local_top / rel, data)
        index[rel] = MANIFEST_TAG
    for rel in set(index) - set(wanted) - set(manifests):  # gone from the store, or no longer visible
        (local_top / rel).unlink(missing_ok=True)
        del index[rel]
    local_top.mkdir(parents=True, exist_ok=True)
    disk.write_atomic(index_path, json.dumps(index))
    return local_top
