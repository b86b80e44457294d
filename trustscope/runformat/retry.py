"""Retries of an object store's calls: the :class:`RetryPolicy` (exponential backoff with full jitter, bounded attempts
and a deadline per operation), the classification of a store's failures (:func:`fault_kind`), their counts
(:class:`FaultLog`) and the one layer that retries (:class:`Retrier`, :class:`RetryingFS`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from trustscope.runformat.layout import SCHEME

RETRY_OPTION = "trustscope_retry"
"""The ``storage_options`` key of the retry policy (a dict of :class:`RetryPolicy` fields); not passed to s3fs."""


log = logging.getLogger("trustscope.storage")


_T = TypeVar("_T")


class StorageError(OSError):
    """An object store that cannot be used: the message names the URL and the cause."""


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
                forget_frames(err)  # retried: its frames need not outlive it
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


def forget_frames(err: BaseException) -> None:
    """Drop the traceback of an expected error (a missing object): its frames, s3fs's coroutines among them, would
    keep the file system and its client alive after the store is closed."""
    seen: set[int] = set()
    chain: BaseException | None = err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        chain.__traceback__ = None
        chain = chain.__cause__ or chain.__context__
