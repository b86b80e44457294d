"""A fault-injecting HTTP proxy between S3 clients and a local S3 endpoint (the moto server of ``test_s3.py``).

:class:`FaultProxy` listens on 127.0.0.1 and forwards each HTTP request to the endpoint, unless a fault is due for
that kind of request: the clients are the real botocore/s3fs ones, speaking real HTTP to the proxy. Requests are
sorted by kind (:func:`request_kind`):

- ``upload``: PUT (or multipart POST/PUT) of a data object,
- ``manifest``: PUT of a rank manifest (``run.json``, ``ranks/rank<r>.json``), the commit of a flush,
- ``list``: a bucket listing (GET on the bucket),
- ``read``: GET or HEAD of an object,
- ``delete``: DELETE of an object, or a bulk delete,
- ``bucket``: anything else on the bucket itself (HEAD bucket at open).

and the faults (:data:`FAULTS`) are those object stores show under load:

- ``slowdown``: ``503 SlowDown`` with S3's XML error body,
- ``internal``: ``500 InternalError``,
- ``reset``: the connection reset mid-request (after half the request body, or for a request without a body after
  half the response),
- ``lost_reply``: the request reaches the store and is carried out, then the connection is reset before the reply
  (the client cannot tell whether it happened),
- ``stall``: no answer for :attr:`FaultProxy.stall_s` seconds (set it above the client's read timeout), then the
  connection is closed.

Faults are scheduled by :meth:`FaultProxy.inject` (the next ``times`` requests of a kind, after ``skip``) or drawn
at random by :meth:`FaultProxy.chaos`; :attr:`FaultProxy.injected` records each fault dealt.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

KINDS = ("upload", "manifest", "list", "read", "delete", "bucket")
FAULTS = ("slowdown", "internal", "reset", "lost_reply", "stall")
MANIFEST_KEY = re.compile(r"(^|/)(run\.json|ranks/rank\d+\.json)$")

_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
}


def request_kind(method: str, target: str) -> str:
    """The kind of an S3 request (path-style addressing: ``/bucket/key?query``)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    _, _, key = parts.path.lstrip("/").partition("/")
    if method == "DELETE" or (method == "POST" and "delete" in query):
        return "delete"
    if not key:
        return "list" if method == "GET" else "bucket"
    if method in ("PUT", "POST"):
        return "manifest" if MANIFEST_KEY.search(key) else "upload"
    return "read"


@dataclass
class _Rule:
    kind: str
    fault: str
    times: int
    skip: int


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of ``upstream`` (``host:port``) that injects faults."""

    def __init__(self, upstream: str, stall_s: float = 3.0):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.stall_s = stall_s
        self.requests: Counter = Counter()
        """Requests seen, by kind."""
        self.injected: list[tuple[str, str, str, str]] = []
        """(kind, fault, method, path) of every fault dealt, in order."""
        self._rules: list[_Rule] = []
        self._chaos: tuple[float, tuple[str, ...], tuple[str, ...], random.Random] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="s3-fault-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------------ schedule

    def inject(self, kind: str, fault: str, times: int = 1, skip: int = 0) -> None:
        """Deal ``fault`` to the next ``times`` requests of ``kind``, after letting ``skip`` of them through."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        with self._lock:
            self._rules.append(_Rule(kind, fault, times, skip))

    def chaos(self, rate: float, kinds: tuple[str, ...] = KINDS, faults: tuple[str, ...] = FAULTS,
              seed: int = 0) -> None:
        """Deal a fault drawn from ``faults`` to each request of ``kinds`` with probability ``rate``."""
        with self._lock:
            self._chaos = (rate, tuple(kinds), tuple(faults), random.Random(seed)) if rate > 0 else None

    def clear(self) -> None:
        """No more faults (scheduled or random)."""
        with self._lock:
            self._rules.clear()
            self._chaos = None

    def pending(self) -> int:
        """Faults scheduled and not yet dealt."""
        with self._lock:
            return sum(r.times for r in self._rules)

    def _take(self, kind: str, method: str, path: str) -> str | None:
        with self._lock:
            self.requests[kind] += 1
            fault = None
            for rule in self._rules:
                if rule.kind != kind:
                    continue
                if rule.skip:
                    rule.skip -= 1
                    break
                rule.times -= 1
                fault = rule.fault
                break
            self._rules = [r for r in self._rules if r.times > 0]
            if fault is None and self._chaos is not None:
                rate, kinds, faults, rng = self._chaos
                if kind in kinds and rng.random() < rate:
                    fault = rng.choice(faults)
            if fault is not None:
                self.injected.append((kind, fault, method, path))
            return fault

    # ---------------------------------------------------------------------------------------- plumbing

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _close(conn)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        try:
            while not self._closed.is_set():
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(h.split(":", 1)) for h in lines[1:] if ":" in h]
                names = {k.strip().lower(): v.strip() for k, v in headers}
                kind = request_kind(method, target)
                fault = self._take(kind, method, urlsplit(target).path)
                if names.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(names.get("content-length", 0) or 0)
                chunked = "chunked" in names.get("transfer-encoding", "").lower()
                if fault == "reset" and (length or chunked):
                    reader.exactly(length // 2)  # half the body, then the connection drops
                    _reset(conn)
                    return
                body = reader.chunked() if chunked else reader.exactly(length)
                if body is None:
                    return
                if fault == "stall":
                    self._closed.wait(self.stall_s)
                    return
                if fault in _ERRORS:
                    conn.sendall(_error_response(fault, urlsplit(target).path))
                    continue
                kept = [(k, v) for k, v in headers if k.strip().lower() not in ("expect", "connection")]
                request = "\r\n".join([lines[0], *(f"{k}:{v}" for k, v in kept), "Connection: close", "", ""])
                reply = self._forward(request.encode("latin-1") + body)
                if fault == "lost_reply":
                    _reset(conn)
                    return
                if fault == "reset":  # a request without a body: half the response, then the drop
                    conn.sendall(reply[: max(1, len(reply) // 2)])
                    _reset(conn)
                    return
                conn.sendall(reply)
                reply_head = reply.split(b"\r\n\r\n", 1)[0].lower()
                if b"connection: close" in reply_head or (b"content-length" not in reply_head
                                                         and b"chunked" not in reply_head):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            _close(conn)

    def _forward(self, request: bytes) -> bytes:
        with socket.create_connection(self.upstream, timeout=60) as up:
            up.sendall(request)
            out = []
            while chunk := up.recv(1 << 16):
                out.append(chunk)
        return b"".join(out)


class _Reader:
    """Buffered reads of an HTTP request from a socket; None at end of stream."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buf = conn, b""

    def _more(self) -> bool:
        chunk = self.conn.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def until(self, mark: bytes) -> bytes | None:
        while (i := self.buf.find(mark)) < 0:
            if not self._more():
                return None
        out, self.buf = self.buf[:i], self.buf[i + len(mark):]
        return out

    def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self._more():
                return None
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def chunked(self) -> bytes | None:
        """A chunked body, as sent (chunk sizes, data, trailer)."""
        out = []
        while True:
            size_line = self.until(b"\r\n")
            if size_line is None:
                return None
            out.append(size_line + b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (line := self.until(b"\r\n")) not in (None, b""):
                    out.append(line + b"\r\n")
                out.append(b"\r\n")
                return b"".join(out)
            data = self.exactly(size + 2)
            if data is None:
                return None
            out.append(data)


def _error_response(fault: str, path: str) -> bytes:
    status, reason, code, message = _ERRORS[fault]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"x-amz-request-id: fault-proxy\r\n\r\n")
    return head.encode() + body


def _reset(conn: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection reads on the other side."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
