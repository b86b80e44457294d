"""Alerts: the collapse early warning and doctor failures sent to a webhook (Slack-compatible JSON), and to the
run's trackers that have alerts of their own (W&B, trackio).

    from trustscope.alerts import Alerts
    alerts = Alerts("https://hooks.slack.com/services/...", logger=logger)   # a malformed URL fails here
    alerts.warning(run_id, step, "bad negative updates 1.3% of recent tokens")  # returns at once
    alerts.close()

:meth:`Alerts.send` never blocks and never raises: it puts the alert on a bounded queue that one background thread
posts from. Each alert has a key (``warning:<run>``, ``doctor:<run>:<check>``); a key is sent at most once per
``min_interval_s`` (the rest are counted as ``rate_limited``). A post that fails (refused, a timeout, an HTTP status
of 300 or more) is retried ``retries`` times, waiting ``backoff_s``, then twice that, and so on; a post that still
fails is counted and its error kept. What the alerts did is written into the run's manifest (``alerts`` key of
``run.json``, :meth:`trustscope.logger.TokenLogger.note_alerts`) and each failure is logged on the
``trustscope.alerts`` logger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

LOG = logging.getLogger("trustscope.alerts")
MAX_ERRORS_KEPT = 5


def check_webhook_url(url: str) -> str:
    """``url`` if it is an absolute ``http(s)://host/...`` URL, else a ValueError naming it and what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"webhook url must be an http(s) URL, got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port  # raises on a port that is not a number
    except ValueError as err:
        raise ValueError(f"webhook url {url!r} is malformed: {err}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook url {url!r} must start with http:// or https:// (scheme {parts.scheme!r})")
    if not parts.hostname:
        raise ValueError(f"webhook url {url!r} has no host")
    if port == 0:
        raise ValueError(f"webhook url {url!r} has port 0")
    return url.strip()


def _positive(name: str, value: Any, zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0 \
            or (not zero and value == 0):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


class Alerts:
    """A webhook sender on a background thread, rate-limited per alert key, with retries and backoff.

    Args:
        url: the webhook (``http(s)://...``); checked here, a malformed one raises ``ValueError``. None: no
            webhook, the trackers' alerts only.
        logger: the run's :class:`~trustscope.logger.TokenLogger`: what the alerts did goes into its manifest.
        trackers: a :class:`trustscope.trackers.Trackers` whose W&B and trackio runs get the alert too.
        min_interval_s: at most one alert per key in this many seconds (default 15 minutes).
        timeout_s: one post's time limit; retries: posts after the first; backoff_s: the wait before the first
            retry, doubled for each next one; max_queue: alerts waiting to be sent (more are dropped, counted).
    """

    def __init__(self, url: str | None, *, logger: Any = None, trackers: Any = None, min_interval_s: float = 900.0,
                 timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 2.0, max_queue: int = 64,
                 clock: Callable[[], float] = time.monotonic):
        self.url = None if url is None else check_webhook_url(url)
        self.min_interval_s = _positive("min_interval_s", min_interval_s)
        self.timeout_s = _positive("timeout_s", timeout_s, zero=False)
        self.backoff_s = _positive("backoff_s", backoff_s)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        self.retries = retries
        self.logger = logger
        self.trackers = trackers
        self._clock = clock
        self._last_sent: dict[str, float] = {}
        self._lock = threading.RLock()
        self._counts = {"queued": 0, "sent": 0, "failed": 0, "retried": 0, "rate_limited": 0, "dropped": 0}
        self._errors: list[str] = []
        self._last: dict[str, Any] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trustscope-alerts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- any thread

    def send(self, key: str, text: str, title: str = "trustscope") -> bool:
        """Queue ``text`` under ``key``; False when it is rate-limited, the queue is full or the sender is closed.
        Never blocks, never raises."""
        try:
            now = self._clock()
            with self._lock:
                last = self._last_sent.get(key)
                if last is not None and now - last < self.min_interval_s:
                    self._counts["rate_limited"] += 1
                    return False
                if self._stop.is_set():
                    self._counts["dropped"] += 1
                    return False
                try:
                    self._queue.put_nowait((key, title, text))
                except queue.Full:
                    self._counts["dropped"] += 1
                    self._note()
                    return False
                self._last_sent[key] = now
                self._counts["queued"] += 1
            if self.trackers is not None:
                self.trackers.alert(title, text)
            return True
        except Exception as err:  # an alert must never stop the training
            LOG.warning("trustscope: an alert could not be queued: %s: %s", type(err).__name__, err)
            return False

    def warning(self, run_id: str, step: int, reason: str) -> bool:
        """The collapse early warning of run ``run_id`` at ``step`` (key ``warning:<run_id>``)."""
        return self.send(f"warning:{run_id}", f"trustscope: collapse early warning in run {run_id} at step "
                                              f"{step}: {reason}", title=f"collapse warning: {run_id}")

    def doctor(self, findings: Mapping[str, Sequence[Any]]) -> int:
        """One alert per failed doctor check (``trustscope.doctor.diagnose``'s findings; key
        ``doctor:<run>:<check>``). Returns how many were queued."""
        queued = 0
        for run_id, run_findings in findings.items():
            for f in run_findings:
                if getattr(f, "verdict", None) != "fail":
                    continue
                queued += self.send(f"doctor:{run_id}:{f.check}",
                                    f"trustscope doctor: run {run_id} fails check {f.check!r}: {f.summary}",
                                    title=f"doctor failed: {run_id}")
        return queued

    @property
    def report(self) -> dict[str, Any]:
        """What the alerts did so far: counts (queued, sent, failed, retried, rate_limited, dropped), the first
        errors, the last failure; the same as the manifest's ``alerts`` key."""
        with self._lock:
            return {**self._counts, "errors": list(self._errors), **self._last}

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (waiting up to ``timeout_s``), stop the thread, record the counts. Safe twice."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._note()

    def __enter__(self) -> Alerts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------------------------------- sender thread

    def _run(self) -> None:
        while True:
            try:
                key, _title, text = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._deliver(key, text)
            except Exception as err:  # never let the thread die on an alert
                self._failed(key, err)

    def _deliver(self, key: str, text: str) -> None:
        if self.url is None:
            return
        body = json.dumps({"text": text}).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self._counts["retried"] += 1
                self._stop.wait(self.backoff_s * 2 ** (attempt - 1))  # closing: retried without the wait
            try:
                request = urllib.request.Request(self.url, data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                with self._lock:
                    self._counts["sent"] += 1
                self._note()
                return
            except urllib.error.HTTPError as err:
                error: BaseException = err
                if err.code < 500 and err.code != 429:  # the request itself is wrong: a retry cannot help
                    break
            except (OSError, ValueError) as err:  # refused, unreachable, timed out
                error = err
        self._failed(key, error)

    def _failed(self, key: str, err: BaseException) -> None:
        text = f"{type(err).__name__}: {err}"
        LOG.warning("trustscope: alert %r could not be sent to the webhook: %s", key, text)
        with self._lock:
            self._counts["failed"] += 1
            if len(self._errors) < MAX_ERRORS_KEPT and text not in self._errors:
                self._errors.append(text)
            self._last = {"last_failure": {"key": key, "error": text, "at": datetime.now(UTC).isoformat()}}
        self._note()

    def _note(self) -> None:
        if self.logger is None:
            return
        with contextlib.suppress(Exception):  # the manifest is the logger's; a failure there is its to report
            self.logger.note_alerts(self.report)
