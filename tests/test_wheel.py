"""A reader's install, as ``pip install trustscope`` makes it: the wheel built from this tree, installed with its
default dependencies alone into a fresh venv outside the checkout (no torch, no transformers, no vLLM), serves
``--help``, ``sql``, ``report``, ``doctor``, ``validate``, a JSON-lines import and the dashboard over the sample
runs it ships, from a folder that is not the checkout.

The dependencies come from a wheelhouse kept under ``$TRUSTSCOPE_CACHE/wheelhouse``, filled from the package index
the first time (``pip download``) and read offline after (``--no-index``); the install skips byte-compiling. On a
warm wheelhouse the module takes 65 s at load 1.3-2.9 on 2 cores (51 s of CPU, its servers and browser included), of
which the install is 9 s. ``docs/performance.md`` gives the install's size and time from PyPI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from trustscope.paths import cache_root

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
TRAINER = ("torch", "transformers", "tokenizers", "safetensors", "vllm")
SHIPPED_RUNS = {"sanity-ppo_clip-s0", "sanity-dppo_binary_tv-s0"}  # setup.py's SAMPLE_RUNS
WHEEL_MB = 11.0
"""The wheel stays small: 9.6 MB of the package and the dashboard (0.5 MB), two sample runs (4.4 MB compressed) and
the two shipped toy worlds (4.6 MB)."""

pytestmark = pytest.mark.slow


def build_wheel(out: Path) -> Path:
    """The wheel of this tree, built from a copy of it (the build writes ``build/`` and ``*.egg-info`` beside the
    sources) with the setuptools of this venv, offline."""
    src = out / "src"
    skip = shutil.ignore_patterns("__pycache__", "__catalogue__", "*.egg-info", "*.tmp")
    for name in ("trustscope", "app", "sample_logs"):
        shutil.copytree(ROOT / name, src / name, ignore=skip, symlinks=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(out / "dist")], cwd=src, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "dist" / done.stdout.strip().splitlines()[-1]


def outside_env() -> dict[str, str]:
    """This process's environment without what points Python at the checkout or at this venv. pip run with the
    checkout on ``PYTHONPATH`` (the dashboard's launcher puts it there, ``trustscope._dashboard``) finds the
    checkout's ``trustscope.egg-info``, takes trustscope as installed, and installs its dependencies alone."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """This venv's pip, run as from outside the checkout: without its ``PYTHONPATH`` (:func:`outside_env`) and in
    the cache folder, not the checkout's root, where ``python -m`` would put its ``trustscope.egg-info`` on the
    path again."""
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=timeout, env=outside_env(), cwd=cache_root())


def install(wheel: Path, venv: Path) -> float:
    """Install ``wheel`` and its default dependencies into the bare ``venv``; returns the seconds it took."""
    wheelhouse = cache_root() / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    offline = ("--python", str(venv / "bin" / "python"), "install", "--no-compile", "--no-index", "--find-links",
               str(wheelhouse), str(wheel))
    start = time.perf_counter()
    done = pip(*offline)
    if done.returncode != 0:  # a dependency the wheelhouse lacks yet: fetch it (and its own) from the index
        fetched = pip("download", "--dest", str(wheelhouse), "--only-binary", ":all:", str(wheel))
        assert fetched.returncode == 0, fetched.stderr[-3000:]
        for stale in wheelhouse.glob("trustscope-*.whl"):
            stale.unlink()
        start = time.perf_counter()
        done = pip(*offline)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (venv / "bin" / "trustscope").is_file(), f"pip installed no trustscope script:\n{done.stdout[-3000:]}"
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> dict:
    """The installed wheel: its venv, a folder outside the checkout to run from, and the environment to run in."""
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    seconds = install(wheel, venv)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    env = outside_env()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", TRUSTSCOPE_CACHE=str(base / "cache"),
               PYTHONUNBUFFERED="1")
    return {"wheel": wheel, "venv": venv, "cwd": elsewhere, "env": env, "install_s": seconds}


def run(reader: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(reader["venv"] / "bin" / args[0]), *args[1:]], cwd=reader["cwd"], env=reader["env"],
                          capture_output=True, text=True, timeout=timeout)


def site_packages(reader: dict) -> Path:
    (found,) = (reader["venv"] / "lib").glob("python3*/site-packages")
    return found


def test_the_wheel_holds_the_dashboard_inside_the_package_and_two_sample_runs(reader):
    wheel = reader["wheel"]
    assert wheel.stat().st_size < WHEEL_MB * 2**20, f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MB"
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"trustscope", wheel.name.split("-py3")[0] + ".dist-info"}, tops  # no top-level app
    assert "trustscope/_dashboard/app/main.py" in names and "trustscope/_dashboard/app/views/runs.py" in names
    runs = {name.split("/")[2] for name in names if name.startswith("trustscope/sample_logs/")}
    assert runs == SHIPPED_RUNS
    metadata = zipfile.ZipFile(wheel).read(wheel.name.split("-py3")[0] + ".dist-info/METADATA").decode()
    default = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert default and not [line for line in default if any(f" {lib}" in line for lib in TRAINER)], default


def test_the_reader_install_has_no_trainer_library(reader):
    site = site_packages(reader)
    assert not (site / "app").exists()
    present = [lib for lib in TRAINER if (site / lib).exists()]
    assert present == [], f"the default install brought {present}"
    done = run(reader, "python", "-c", "import importlib.util as u; print([m for m in "
               f"{TRAINER!r} if u.find_spec(m)])")
    assert done.stdout.strip() == "[]", done.stderr
    print(f"install: {reader['install_s']:.1f} s (offline, warm wheelhouse), "
          f"{sum(f.stat().st_size for f in site.rglob('*') if f.is_file()) / 2**20:.0f} MB in site-packages")


def test_the_read_commands_run_from_outside_the_checkout(reader):
    done = run(reader, "trustscope", "--help")
    assert done.returncode == 0 and "dashboard" in done.stdout, done.stderr
    done = run(reader, "trustscope", "sql", "select count(distinct run_id) as runs from tokens", "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert [cell.strip('"') for cell in done.stdout.split()] == ["runs", "2"]
    done = run(reader, "trustscope", "report")
    assert done.returncode == 0, done.stderr
    assert all(r in done.stdout for r in SHIPPED_RUNS), done.stdout[-2000:]
    samples = site_packages(reader) / "trustscope" / "sample_logs"
    done = run(reader, "trustscope", "validate", str(samples))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("match schema version 1") and "2 run(s)" in done.stdout
    done = run(reader, "trustscope", "doctor", str(samples))
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "2 run(s):" in done.stdout and "Traceback" not in done.stderr


def test_a_json_lines_import_and_the_trainer_s_extra(reader):
    from test_importers_cli import WRITERS

    WRITERS["prime-rl"](reader["cwd"] / "src")
    done = run(reader, "trustscope", "import", "prime-rl", "src", "logs", "--run-id", "r")
    assert done.returncode == 0, done.stderr
    done = run(reader, "trustscope", "validate", "logs")
    assert done.returncode == 0 and "ok: 1 run(s)" in done.stdout, done.stdout + done.stderr
    done = run(reader, "trustscope", "train", "--help")
    assert done.returncode == 2
    assert done.stderr.strip() == "trustscope train needs torch, which this install lacks: pip install 'trustscope[train]'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_serves_the_shipped_runs(reader):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(reader["venv"] / "bin" / "trustscope"), "dashboard", "--port", str(port)],
                            cwd=reader["cwd"], env=reader["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"dashboard exited with {proc.returncode}: {proc.stdout.read()}"
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                    if resp.read().strip() == b"ok":
                        break
            except OSError:
                assert time.monotonic() < deadline, "dashboard not healthy after 90 s"
                time.sleep(0.3)
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"<html" in resp.read(4096).lower()
        if CHROMIUM.exists():  # the page drawn: the dashboard's own modules import as `app` in the server
            from playwright.sync_api import sync_playwright

            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox"])
                try:
                    page = browser.new_page()
                    page.goto(url, wait_until="domcontentloaded")
                    page.get_by_role("heading", name="Runs").first.wait_for(timeout=90_000)
                    run_id = page.get_by_text(sorted(SHIPPED_RUNS)[0]).first  # a cell of the runs table
                    run_id.wait_for(state="attached", timeout=90_000)  # (the grid draws on a canvas)
                    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']",
                                           timeout=90_000)
                    errors = page.locator("[data-testid='stException']")
                    assert errors.count() == 0, errors.first.inner_text()[:3000]
                finally:
                    browser.close()
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own session: the server and what it started
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
