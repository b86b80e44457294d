"""trustscope.alerts against an HTTP server on 127.0.0.1 that answers, is slow, answers 500, or refuses: the caller
never waits, failures are retried with backoff and recorded in the run's manifest, a key is rate-limited."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from trustscope.alerts import Alerts, check_webhook_url
from trustscope.logger import TokenLogger
from trustscope.trackers import StepReporter


class Hook:
    """A webhook on 127.0.0.1: ``mode`` ok (200), slow (answers after ``delay`` s), error (500)."""

    def __init__(self, mode: str = "ok", delay: float = 3.0):
        self.mode, self.delay, self.bodies, self.hits = mode, delay, [], 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                hook.hits += 1
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if hook.mode == "slow":
                    time.sleep(hook.delay)
                code = 500 if hook.mode == "error" else 200
                if code == 200:
                    hook.bodies.append((self.headers["Content-Type"], json.loads(body)))
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    made = []

    def make(mode="ok", delay=3.0):
        made.append(Hook(mode, delay))
        return made[-1]

    yield make
    for h in made:
        h.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"  # nothing listens there: connections are refused


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_an_alert_is_posted_as_slack_json_and_rate_limited_per_key(hook):
    h = hook("ok")
    alerts = Alerts(h.url, min_interval_s=600)
    assert alerts.warning("run-a", 12, "bad negative updates 2.00% of recent tokens")
    assert not alerts.warning("run-a", 13, "again")  # the same key within min_interval_s
    assert alerts.warning("run-b", 13, "another run")
    assert wait_for(lambda: alerts.report["sent"] == 2)
    alerts.close()
    assert [b for _, b in h.bodies] == [
        {"text": "trustscope: collapse early warning in run run-a at step 12: bad negative updates 2.00% of recent "
                 "tokens"},
        {"text": "trustscope: collapse early warning in run run-b at step 13: another run"}]
    assert {t for t, _ in h.bodies} == {"application/json"}
    assert alerts.report | {"errors": []} == {"queued": 2, "sent": 2, "failed": 0, "retried": 0, "rate_limited": 1,
                                             "dropped": 0, "errors": []}


def test_rate_limit_opens_again_after_the_interval(hook):
    now = [100.0]
    alerts = Alerts(hook("ok").url, min_interval_s=60, clock=lambda: now[0])
    assert alerts.send("k", "one") and not alerts.send("k", "two")
    now[0] += 61
    assert alerts.send("k", "three")
    alerts.close()


@pytest.mark.parametrize("mode", ["slow", "error", "refused"])
def test_a_failing_webhook_never_blocks_the_caller_and_is_recorded(mode, hook, tmp_path):
    """Slow (past the post's time limit), 500, refused: send returns at once, each post is retried with backoff,
    the failure lands in the run's manifest and the log; the logger goes on logging meanwhile."""
    url = closed_port_url() if mode == "refused" else hook(mode, delay=2.0).url
    rng = np.random.default_rng(0)
    with TokenLogger(tmp_path, "r", flush_seconds=0.2) as logger:
        alerts = Alerts(url, logger=logger, timeout_s=0.3, retries=1, backoff_s=0.05)
        start = time.perf_counter()
        for i in range(3):
            alerts.send(f"k{i}", f"alert {i}")
        took = time.perf_counter() - start
        logger.log_step(0, scalars={"loss": 1.0})  # training goes on while the posts fail
        assert wait_for(lambda: alerts.report["failed"] == 3, timeout=60)
        alerts.close()
        logger.log_step(1, tokens={"token_id": rng.integers(0, 9, (2, 3)), "mu_logprob": -np.ones((2, 3)),
                                   "pi_logprob": -np.ones((2, 3)), "advantage": np.ones(2), "prompt_id": [0, 1]},
                        mask=np.ones((2, 3), bool))
    assert took < 0.05, f"send blocked the caller for {took:.3f} s"
    report = alerts.report
    assert report["sent"] == 0 and report["retried"] == 3  # one retry per alert
    assert report["last_failure"]["key"] == "k2"
    manifest = json.loads((tmp_path / "r" / "run.json").read_text())
    assert manifest["status"] == "finished"
    assert manifest["alerts"]["failed"] == 3 and manifest["alerts"]["errors"]
    expected = {"slow": "timed out", "error": "500", "refused": "refused"}[mode]
    assert expected in " ".join(manifest["alerts"]["errors"]).lower(), manifest["alerts"]["errors"]


def test_a_full_queue_drops_and_counts():
    alerts = Alerts(closed_port_url(), max_queue=1, retries=0, timeout_s=0.2)
    sent = [alerts.send(f"k{i}", "x") for i in range(50)]  # the thread takes at most a few meanwhile
    alerts.close()
    assert sent.count(False) == alerts.report["dropped"] > 0


@pytest.mark.parametrize("url, why", [
    ("hooks.slack.com/services/T0/B0/x", "must start with http"),
    ("ftp://example.com/hook", "must start with http"),
    ("https:///services/x", "has no host"),
    ("http://example.com:port/x", "malformed"),
    ("", "must be an http"),
])
def test_a_malformed_url_fails_at_start(url, why):
    with pytest.raises(ValueError, match=why):
        Alerts(url)
    with pytest.raises(ValueError, match=why):
        check_webhook_url(url)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="min_interval_s must be"):
        Alerts(None, min_interval_s=-1)
    with pytest.raises(ValueError, match="retries must be"):
        Alerts(None, retries=1.5)


def test_doctor_failures_are_sent_one_per_failed_check(hook):
    from trustscope.doctor import Finding

    h = hook("ok")
    findings = {"run-a": [Finding("fail", "mu and pi one position apart", check="alignment"),
                          Finding("ok", "fine", check="topk_mass")],
                "run-b": [Finding("warn", "some", check="alignment")]}
    alerts = Alerts(h.url)
    assert alerts.doctor(findings) == 1
    assert wait_for(lambda: alerts.report["sent"] == 1)
    alerts.close()
    assert h.bodies[0][1] == {"text": "trustscope doctor: run run-a fails check 'alignment': mu and pi one position "
                                      "apart"}


def test_the_early_warning_reaches_the_webhook_from_the_step_summaries(hook, tmp_path):
    """A run whose bad negative updates cross the line: the reporter's warning goes out once (rate-limited)."""
    h = hook("ok")
    rng = np.random.default_rng(1)
    with TokenLogger(tmp_path, "r") as logger:
        alerts = Alerts(h.url, logger=logger)
        reporter = StepReporter(logger, wait_s=60.0, alerts=alerts)
        reporter.warning.lines = type(reporter.warning.lines)(bad_rate=0.05, window=2)
        fired = []
        for step in range(6):
            mu = np.full((4, 8), np.log(0.9))
            pi = mu.copy()
            if step >= 3:  # negative tokens whose pi fell far below mu: bad negative updates
                pi[:, :4] = np.log(0.05)
            logger.log_step(step, tokens={"token_id": rng.integers(0, 9, (4, 8)), "mu_logprob": mu, "pi_logprob": pi,
                                          "advantage": -np.ones(4), "prompt_id": np.arange(4)},
                            mask=np.ones((4, 8), bool))
            fired.append(reporter.metrics()["trustscope/warning"])
        assert wait_for(lambda: alerts.report["sent"] == 1)
        alerts.close()
    assert fired == [0, 0, 0, 1, 1, 1]
    assert alerts.report["rate_limited"] == 2
    assert h.bodies[0][1]["text"].startswith("trustscope: collapse early warning in run r at step 3: bad negative")
    assert json.loads((tmp_path / "r" / "run.json").read_text())["alerts"]["sent"] == 1


def test_doctor_command_posts_its_failed_checks(hook, tmp_path):
    """``trustscope doctor --webhook``: two ranks reusing sample ids fail rank_collisions, which is posted."""
    from typer.testing import CliRunner

    from trustscope.cli import app

    h = hook("ok")
    rng = np.random.default_rng(2)
    loggers = [TokenLogger(tmp_path, "clash", rank=r, fsync=False) for r in range(2)]
    for step in range(2):
        for logger in loggers:
            mu = np.log(rng.uniform(0.1, 1.0, (4, 5)))
            logger.log_step(step, tokens={"token_id": rng.integers(0, 9, (4, 5)), "mu_logprob": mu, "pi_logprob": mu,
                                          "advantage": np.ones(4), "sample_id": np.arange(4),
                                          "prompt_id": np.arange(4)}, mask=np.ones((4, 5), bool))
    for logger in loggers:
        logger.close()
    bad = CliRunner().invoke(app, ["doctor", str(tmp_path), "--webhook", "hooks.slack.com/x"])
    assert bad.exit_code == 2 and "--webhook: webhook url 'hooks.slack.com/x' must start with http" in bad.output
    assert h.bodies == []
    result = CliRunner().invoke(app, ["doctor", str(tmp_path), "--webhook", h.url])
    assert result.exit_code == 1, result.output
    texts = [b["text"] for _, b in h.bodies]
    assert texts and all(t.startswith("trustscope doctor: run clash fails check ") for t in texts)
    assert any("'rank_collisions'" in t for t in texts) and f"webhook: {len(texts)} alert(s) sent" in result.output
