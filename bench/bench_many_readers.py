"""Many readers at once: browser sessions walking every dashboard page together over a ~1M-token log while a live
run keeps logging into it, the server's memory sampled throughout.

    .venv/bin/python -m bench.bench_many_readers                      # 8 sessions, 1M tokens in /tmp, 1 walk each
    .venv/bin/python -m bench.bench_many_readers --sessions 8 --walks 3 --json /tmp/many.json
    .venv/bin/python -m bench.bench_many_readers --logdir sample_logs --reuse --no-live

What runs, in one command:

- **The log**: ``--tokens`` tokens (default 1M) over ``--runs`` synthetic runs written by the real
  :class:`trustscope.logger.TokenLogger` (:mod:`trustscope.synthetic`), kept under ``--logdir`` (default
  ``/tmp/trustscope-many-readers/logs``) and reused by the next invocation with the same shape.
- **A live run**: a writer subprocess logs run ``live`` into the same directory, one step of ``--live-tokens`` tokens
  every ``--live-interval`` seconds, each step flushed to a committed file (and compacted every 10, the logger's
  default), from before the first server starts until the end: every reader sees files land while it reads.
- **Two fresh servers**, each ``trustscope dashboard LOGDIR`` with a new, empty cache (:class:`bench_dashboard.Server`):
  first one reader alone, then ``--sessions`` readers at once, so the ratio compares like with like (both cold).
- **The readers**: one headless Chromium per session (its own playwright driver, in its own thread; so 8 browsers,
  not 8 contexts of one: a session's browser work does not queue behind another's in one browser process). All
  start together; each opens the dashboard's landing page in a new tab (a new Streamlit session), then walks every
  other page of :data:`app.pages.PAGES` through the sidebar's menu, ``--walks`` times. A page's time is from the
  request (the goto, or the click) to its answer drawn (:func:`bench_dashboard._wait_drawn`: the script run over,
  the page's ready selector shown, every plotly chart laid out). A page that shows a Streamlit exception or an error
  box, or is not drawn within :func:`bench_dashboard._wait_drawn`'s waits (120 s to its heading and the end of its
  script run, 60 s more to its ready selector and its charts) is a failure.
- **The server's memory**: the resident set of the Streamlit process and of it with its children (the warm-up
  process, the SQL console's worker), sampled every 0.5 s: the baseline (the server idle before any reader), the
  peak while the readers read, and after (every reader gone, ``--after`` seconds later), per walk too; and what
  ``st.cache_data`` holds once the readers are done (the server's ``/_stcore/metrics``).

Prints a table per phase and the ratio of each page's median under many readers to one reader alone, and writes
every figure as JSON (``--json``). The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import common

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from app.pages import PAGES, Page  # noqa: E402
from bench.bench_dashboard import CHROMIUM, CHROMIUM_ARGS, Server, _wait_drawn, navigate  # noqa: E402

DEFAULT_LOGDIR = Path("/tmp/trustscope-many-readers/logs")
LIVE_RUN = "live"
RULES = ("ppo_clip", "dppo_binary_tv", "grpo", "pg_is")
"""The rules of the synthetic runs, one per run in turn (the PPO-clip baseline first, as the Runs page expects)."""
SAMPLE_S = 0.5
MB = 1 << 20


# ------------------------------------------------------------------------------------------------ the logs


def build_log(logdir: Path, tokens: int, runs: int, steps: int) -> Path:
    """``runs`` synthetic runs of ``tokens // runs`` tokens each under ``logdir``, reused when a previous call
    wrote the same shape there (a marker file says which); the live run of an earlier invocation is removed."""
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    for name, value in (("tokens", tokens), ("runs", runs), ("steps", steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    marker = logdir / f".many-readers-{tokens}-{runs}-{steps}"
    shutil.rmtree(logdir / LIVE_RUN, ignore_errors=True)
    if marker.exists():
        return logdir
    if logdir.exists():
        if any(p.name != LIVE_RUN and (p / "run.json").exists() for p in logdir.iterdir()) and not any(
                logdir.glob(".many-readers-*")):
            raise FileExistsError(f"--logdir {logdir} holds runs this bench did not write; give an empty or new "
                                  "directory (or --reuse to read it as it is)")
        shutil.rmtree(logdir)
    logdir.mkdir(parents=True)
    start = time.monotonic()
    print(f"writing {tokens:,} tokens over {runs} runs into {logdir} ...", flush=True)
    cfg = SyntheticConfig(tokens=max(1, tokens // runs), steps=steps)
    generate_logdir(logdir, runs=runs, config=cfg, rules=RULES)
    marker.write_text(f"{tokens} tokens, {runs} runs, {steps} steps\n")
    print(f"  written in {time.monotonic() - start:.0f} s", flush=True)
    return logdir


def write_live(logdir: Path, run_id: str, step_tokens: int, interval_s: float, steps: int, seed: int = 7) -> None:
    """Log ``run_id`` into ``logdir`` as a trainer does, one step of ``step_tokens`` synthetic tokens every
    ``interval_s`` seconds, each flushed to a committed file; ends after ``steps`` steps or on SIGTERM, closing the
    run (its manifest says finished)."""
    import numpy as np

    from trustscope import synthetic
    from trustscope.logger import TokenLogger

    cfg = synthetic.SyntheticConfig(tokens=step_tokens * steps, steps=steps, loss_rule="ppo_clip", seed=seed,
                                    edge_cases=False)
    vocab = synthetic.make_vocab(cfg.vocab_size)
    logger = TokenLogger(logdir, run_id, config={**cfg.__dict__}, model={"name": "synthetic"},
                         tokenizer={"name": "synthetic"}, sampling={"topk": cfg.k, "temperature": 1.0}, vocab=vocab,
                         loss_rule=cfg.loss_rule, flush_rows=max(1, 2 * step_tokens), flush_seconds=1e9, fsync=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng, texts = np.random.default_rng(seed), np.array(vocab, dtype=object)
    try:
        for step in range(steps):
            synthetic._log_step([logger], rng, cfg, step, step_tokens, texts)
            logger.flush()
            if stop.wait(interval_s):
                break
    finally:
        logger.close()


class LiveWriter:
    """:func:`write_live` in a subprocess (this script's ``--write-live``)."""

    def __init__(self, logdir: Path, step_tokens: int, interval_s: float, steps: int = 100_000) -> None:
        self.logdir = logdir
        self.proc = subprocess.Popen(
            [*common.module_cmd(__spec__), "--write-live", str(logdir), "--live-tokens",
             str(step_tokens), "--live-interval", str(interval_s), "--live-steps", str(steps)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_first_step(self, timeout_s: float = 300.0) -> None:
        """Until the live run's first step is committed (its manifest and a tokens file there)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the live writer exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            if (self.logdir / LIVE_RUN / "run.json").exists() and self.steps() > 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the live writer committed no step in {timeout_s:.0f} s")

    def steps(self) -> int:
        """Steps of the live run committed so far (its manifest's ``last_step`` + 1; 0 before the first)."""
        try:
            last = json.loads((self.logdir / LIVE_RUN / "run.json").read_text()).get("last_step")
        except (OSError, ValueError):
            return 0
        return 0 if last is None else int(last) + 1

    def close(self) -> int:
        """Stop the writer (SIGTERM: it closes its run) and return its exit code; a writer that died early raises."""
        if self.proc.poll() is not None and self.proc.returncode != 0:
            raise RuntimeError(f"the live writer exited with {self.proc.returncode}: {self.proc.stderr.read()}")
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ------------------------------------------------------------------------------------------------ memory


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def process_tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of ``pid`` alone and of ``pid`` with every process descended from it."""
    tree, total, todo = _children(), 0, [pid]
    while todo:
        current = todo.pop()
        total += _rss(current)
        todo += tree.get(current, [])
    return _rss(pid), total


class MemorySampler:
    """The resident memory of a process and its children every :data:`SAMPLE_S` seconds, in a thread; ``mark``
    names the phase the next samples belong to."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, str, int, int]] = []
        """``(seconds since start, phase, server bytes, server and children bytes)``."""
        self.phase = "baseline"
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            alone, tree = process_tree_rss(self.pid)
            if alone:
                self.samples.append((time.monotonic() - self._start, self.phase, alone, tree))
            self._stop.wait(SAMPLE_S)

    def mark(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, prefix: str = "") -> dict[str, dict[str, float]]:
        """Per phase (those starting with ``prefix``): the median and peak MiB of the server and of its tree."""
        phases: dict[str, dict[str, float]] = {}
        for name in dict.fromkeys(s[1] for s in self.samples if s[1].startswith(prefix)):
            alone = [s[2] / MB for s in self.samples if s[1] == name]
            tree = [s[3] / MB for s in self.samples if s[1] == name]
            phases[name] = {"samples": len(alone), "server_median_mib": statistics.median(alone),
                            "server_peak_mib": max(alone), "tree_median_mib": statistics.median(tree),
                            "tree_peak_mib": max(tree)}
        return phases

    def peak_mib(self, phase_prefix: str = "") -> float:
        """The largest server-and-children sample of the phases starting with ``phase_prefix``, in MiB."""
        return max((s[3] / MB for s in self.samples if s[1].startswith(phase_prefix)), default=0.0)


def cache_data_bytes(url: str) -> dict[str, int]:
    """Serialized bytes each ``st.cache_data`` function of the server at ``url`` holds now (its
    ``/_stcore/metrics``, family ``cache_memory_bytes``), by function name."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/_stcore/metrics?families=cache_memory_bytes", timeout=60) as resp:
        text = resp.read().decode()
    held = {}
    for line in text.splitlines():
        match = re.match(r'cache_memory_bytes\{cache_type="st_cache_data",cache="([^"]+)"\} (\d+)', line)
        if match:
            held[match.group(1)] = int(match.group(2))
    return held


def wait_warm_up(pid: int, timeout_s: float) -> None:
    """Until the server's warm-up child (:func:`app.launch.warm_up`) has ended, so the baseline is an idle server."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = _children().get(pid, [])
        if not any(b"db.refresh(VIEWS)" in _cmdline(k) for k in kids):
            return
        time.sleep(0.25)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ------------------------------------------------------------------------------------------------ the readers


@dataclass
class Visit:
    """One page drawn (or not) in one session."""

    session: int
    walk: int
    page: str
    how: str
    """'open' (a new tab on the page: a new session) or 'menu' (a click in the sidebar of the same tab)."""
    seconds: float
    error: str | None = None


@dataclass
class Session:
    """One reader's visits, in order, and what stopped it, if anything did before its walk ended."""

    index: int
    visits: list[Visit] = field(default_factory=list)
    error: str | None = None


def _failure(tab, page: Page) -> str | None:
    """What is wrong with the drawn page: a Streamlit exception or an error box (None: it answered)."""
    exceptions = tab.locator("[data-testid='stException']")
    if exceptions.count():
        return f"/{page.url_path}: exception on the page: {' '.join(exceptions.first.inner_text().split())[:600]}"
    boxes = tab.locator("[data-testid='stAlertContentError']")
    if boxes.count():
        return f"/{page.url_path}: error box: {boxes.first.inner_text()[:300]}"
    return None


def _visit(tab, page: Page, how: str, url: str) -> tuple[float, str | None]:
    start = time.monotonic()
    try:
        if how == "open":
            tab.goto(f"{url}/{page.url_path}", wait_until="commit")
            _wait_drawn(tab, page)
        else:
            navigate(tab, page)
        seconds = time.monotonic() - start
        return seconds, _failure(tab, page)
    except Exception as exc:  # a timeout, an exception on the page: recorded, the walk goes on
        seconds = time.monotonic() - start
        why = f"/{page.url_path}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        with contextlib.suppress(Exception):  # the page's own exception says more than the wait that ran out
            why = _failure(tab, page) or why
        return seconds, why


def read_all_pages(index: int, url: str, pages: list[Page], walks: int, start: threading.Barrier,
                   walked: threading.Barrier | None, timeout_s: float) -> Session:
    """One reader: its own Chromium; the first page opened in a new tab, then every other page through the menu,
    ``walks`` times over. ``start`` lines the readers up; ``walked`` (when given) after each walk."""
    from playwright.sync_api import sync_playwright

    session = Session(index)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                tab = browser.new_page(viewport={"width": 1400, "height": 2000})
                tab.set_default_timeout(timeout_s * 1000)  # the menu's click; the waits are _wait_drawn's own
                start.wait()
                for walk in range(walks):
                    for i, page in enumerate(pages):
                        how = "open" if walk == 0 and i == 0 else "menu"
                        seconds, error = _visit(tab, page, how, url)
                        session.visits.append(Visit(index, walk, page.title, how, seconds, error))
                    if walked is not None:
                        walked.wait()
            finally:
                browser.close()
    except threading.BrokenBarrierError:
        session.error = "another reader stopped before the walks were lined up"
    except Exception as exc:  # the browser itself failed: said in the result
        session.error = f"{type(exc).__name__}: {exc}"
        for barrier in (start, walked):
            if barrier is not None:
                barrier.abort()
    return session


def read_together(url: str, sessions: int, pages: list[Page], walks: int, timeout_s: float,
                  on_walk: Callable[[int], None] | None = None) -> list[Session]:
    """``sessions`` readers (:func:`read_all_pages`) in threads, started together; ``on_walk(n)`` is called once
    every reader has finished walk ``n`` (0-based), before any starts the next."""
    results: list[Session | None] = [None] * sessions
    walk_count = [0]

    def walked() -> None:
        if on_walk is not None:
            on_walk(walk_count[0])
        walk_count[0] += 1

    start = threading.Barrier(sessions + 1)
    after_walk = threading.Barrier(sessions, action=walked)

    def run(i: int) -> None:
        results[i] = read_all_pages(i, url, pages, walks, start, after_walk, timeout_s)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(sessions)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(timeout=300)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


# ------------------------------------------------------------------------------------------------ a phase


@dataclass
class Phase:
    """One fresh server read by ``sessions`` readers: per page the seconds of every visit and the failures, and
    the server's memory per phase of the sampler."""

    sessions: int
    walks: int
    server_start_s: float
    wall_s: float
    visits: list[Visit]
    session_errors: list[str]
    memory: dict[str, dict[str, float]]
    cache_data: dict[str, int]
    """Serialized bytes per ``st.cache_data`` function once every reader was done (:func:`cache_data_bytes`)."""
    load: tuple[float, float]
    """The 1-minute load average at the phase's start and end."""

    @property
    def failures(self) -> list[str]:
        return [f"session {v.session} walk {v.walk}: {v.error}" for v in self.visits if v.error] + [
            f"session: {e}" for e in self.session_errors]

    def per_page(self) -> dict[str, dict[str, float]]:
        """Per page: the median and max seconds over every session's visits that answered, and the failures."""
        out = {}
        for title in dict.fromkeys(v.page for v in self.visits):
            good = [v.seconds for v in self.visits if v.page == title and not v.error]
            out[title] = {"answered": len(good), "failed": sum(1 for v in self.visits if v.page == title and v.error),
                          "median_s": statistics.median(good) if good else float("nan"),
                          "max_s": max(good) if good else float("nan")}
        return out

    def peak_mib(self) -> float:
        return max((m["tree_peak_mib"] for k, m in self.memory.items() if k.startswith("walk")), default=0.0)


def run_phase(logdir: Path, sessions: int, pages: list[Page], walks: int, timeout_s: float, after_s: float,
              baseline_s: float = 3.0, warm_up_timeout_s: float = 120.0, main: Path | None = None,
              ready: Callable[[], None] | None = None) -> Phase:
    """A fresh server over ``logdir``, its idle memory for ``baseline_s`` once its warm-up ended (and ``ready()``
    returned: the live run's first step committed), ``sessions`` readers walking ``pages`` ``walks`` times
    together, then its memory for ``after_s`` with every reader gone."""
    load_start = os.getloadavg()[0]
    server = Server(logdir, main)
    try:
        wait_warm_up(server.proc.pid, warm_up_timeout_s)
        if ready is not None:
            ready()
        sampler = MemorySampler(server.proc.pid)
        time.sleep(baseline_s)
        sampler.mark("walk 1")
        start = time.monotonic()
        done = read_together(server.url, sessions, pages, walks, timeout_s,
                             on_walk=lambda n: sampler.mark(f"walk {n + 2}" if n + 1 < walks else "after"))
        wall = time.monotonic() - start
        sampler.mark("after")
        cached = cache_data_bytes(server.url)
        time.sleep(after_s)
        sampler.stop()
        if server.proc.poll() is not None:
            raise RuntimeError(f"the dashboard server exited with {server.proc.returncode} while it was read")
    finally:
        server.close()
    visits = [v for s in done for v in s.visits]
    errors = [f"{s.index}: {s.error}" for s in done if s.error] + [
        "a reader thread returned nothing"] * (sessions - len(done))
    return Phase(sessions, walks, server.started, wall, visits, errors, sampler.summary(), cached,
                 (load_start, os.getloadavg()[0]))


def print_phase(name: str, phase: Phase) -> None:
    print(f"\n{name}: {phase.sessions} session(s) x {phase.walks} walk(s), {phase.wall_s:.1f} s wall, "
          f"load average {phase.load[0]:.1f} -> {phase.load[1]:.1f}")
    print(f"  {'page':<22}{'answered':>10}{'failed':>8}{'median s':>10}{'max s':>8}")
    for title, row in phase.per_page().items():
        print(f"  {title:<22}{row['answered']:>10}{row['failed']:>8}{row['median_s']:>10.2f}{row['max_s']:>8.2f}")
    print(f"  server memory (MiB): {'phase':<10}{'server med':>12}{'peak':>8}{'+children med':>15}{'peak':>8}")
    for label, m in phase.memory.items():
        print(f"  {'':<21}{label:<10}{m['server_median_mib']:>12.0f}{m['server_peak_mib']:>8.0f}"
              f"{m['tree_median_mib']:>15.0f}{m['tree_peak_mib']:>8.0f}")
    print(f"  st.cache_data held {sum(phase.cache_data.values()) / MB:.1f} MiB serialized once the readers were "
          f"done ({len(phase.cache_data)} functions)")
    for failure in phase.failures:
        print(f"  FAILED {failure}")


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=DEFAULT_LOGDIR)
    parser.add_argument("--reuse", action="store_true", help="read --logdir as it is (write no synthetic runs)")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens over every synthetic run")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--walks", type=int, default=1, help="times each session walks every page")
    parser.add_argument("--pages", help="comma-separated page files' stems (default: every page)")
    parser.add_argument("--no-live", action="store_true", help="no writer logging a live run while they read")
    parser.add_argument("--live-tokens", type=int, default=4000, help="tokens per step of the live run")
    parser.add_argument("--live-interval", type=float, default=2.0, help="seconds between the live run's steps")
    parser.add_argument("--live-steps", type=int, default=100_000, help=argparse.SUPPRESS)
    parser.add_argument("--no-solo", action="store_true", help="skip the one-reader baseline")
    parser.add_argument("--page-timeout", type=float, default=120.0, help="seconds a menu click may wait")
    parser.add_argument("--after", type=float, default=10.0, help="seconds the memory is sampled after the readers")
    parser.add_argument("--app", type=Path, help="another checkout's app/main.py to serve (a before/after)")
    parser.add_argument("--json", type=Path, default=DEFAULT_LOGDIR.parent / "result.json")
    parser.add_argument("--write-live", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_live is not None:  # the writer subprocess
        write_live(args.write_live, LIVE_RUN, args.live_tokens, args.live_interval, args.live_steps)
        return {}
    for name in ("sessions", "walks", "live_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    pages = [p for p in PAGES if not args.pages or Path(p.file).stem in args.pages.split(",")]
    if not pages:
        parser.error(f"--pages {args.pages!r} names no page of {[Path(p.file).stem for p in PAGES]}")
    logdir = args.logdir.resolve()
    if not args.reuse:
        build_log(logdir, args.tokens, args.runs, args.steps)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start; {logdir}", flush=True)
    writer = None if args.no_live else LiveWriter(logdir, args.live_tokens, args.live_interval, args.live_steps)
    phases: dict[str, Phase] = {}
    try:
        if writer is not None:
            writer.wait_first_step()
        if not args.no_solo:
            phases["one reader"] = run_phase(logdir, 1, pages, args.walks, args.page_timeout, args.after,
                                             main=args.app)
            print_phase("one reader", phases["one reader"])
        phases["many readers"] = run_phase(logdir, args.sessions, pages, args.walks, args.page_timeout, args.after,
                                           main=args.app)
        print_phase(f"{args.sessions} readers at once", phases["many readers"])
    finally:
        live_steps = writer.steps() if writer is not None else 0
        if writer is not None:
            writer.close()
    ratios = {}
    if "one reader" in phases:
        solo, many = phases["one reader"].per_page(), phases["many readers"].per_page()
        ratios = {t: many[t]["median_s"] / solo[t]["median_s"] for t in many if t in solo and solo[t]["answered"]}
        print(f"\nmedian under {args.sessions} readers / one reader alone:")
        for title, ratio in ratios.items():
            print(f"  {title:<22}x{ratio:.2f}")
    failures = sum(len(p.failures) for p in phases.values())
    print(f"\nlive run: {live_steps} steps committed while read; failures: {failures}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "logdir": str(logdir), "tokens": args.tokens, "runs": args.runs, "sessions": args.sessions,
        "walks": args.walks, "browsers": "one headless Chromium per session (its own playwright driver and thread)",
        "live": None if writer is None else {"tokens_per_step": args.live_tokens, "interval_s": args.live_interval,
                                             "steps_committed": live_steps},
        "cpus": os.cpu_count(), "ratio_of_medians": ratios,
        "phases": {name: {**{k: v for k, v in asdict(p).items() if k != "visits"}, "per_page": p.per_page(),
                          "failures": p.failures, "visits": [asdict(v) for v in p.visits]}
                   for name, p in phases.items()},
    }, indent=1))
    print(f"written {args.json}")
    if failures:
        sys.exit(1)
    return {"live_steps_committed": live_steps, "failures": failures, "x_one_reader": ratios,
            **{name: {"wall_s": p.wall_s, "per_page": p.per_page(), "memory_mib": p.memory,
                      "cache_data_mib": sum(p.cache_data.values()) / MB} for name, p in phases.items()}}


if __name__ == "__main__":
    main()
