"""The wheel's layout, which ``pyproject.toml`` alone cannot say (everything else is declared there).

- The dashboard (``app/`` at the top of the repository) ships as ``trustscope/_dashboard/app``: a wheel that put a
  top-level ``app`` into site-packages would collide with any other project's ``app``. The dashboard's own modules
  still import it as ``app`` (``from app import data``): :mod:`trustscope._dashboard` puts its folder on the
  server's ``sys.path``.
- Two of ``sample_logs/``'s runs ship as ``trustscope/sample_logs``, what ``trustscope dashboard``, ``sql`` and
  ``report`` open when no log directory is given and there is no checkout (:func:`trustscope.paths.sample_logdir`).

``docs/architecture.md`` ("Packaging") says why; ``tests/test_wheel.py`` builds the wheel and installs it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
DASHBOARD = "trustscope._dashboard"
SAMPLE_RUNS = ("sanity-ppo_clip-s0", "sanity-dppo_binary_tv-s0")
"""The shipped runs: the PPO clip baseline and DPPO's binary-TV rule on the same task (2.8 MB each, 150 steps of
``sanity-climb-stale``)."""

APP_PACKAGES = find_namespace_packages(where=str(HERE), include=["app", "app.*"], exclude=["*.__pycache__"])
"""The dashboard's packages (``app.views`` holds pages only, no ``__init__.py``)."""


class BuildPy(build_py):
    """``build_py`` that also copies the shipped sample runs into the built package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's sample_logs/ in place
            return
        for run in SAMPLE_RUNS:
            src = HERE / "sample_logs" / run
            if not (src / "run.json").is_file():
                raise FileNotFoundError(f"sample run {src} is missing: the wheel ships it (setup.py SAMPLE_RUNS)")
            dest = Path(self.build_lib) / "trustscope" / "sample_logs" / run
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__catalogue__", "*.tmp"))


setup(
    packages=[*find_namespace_packages(where=str(HERE), include=["trustscope", "trustscope.*"],
                                       exclude=["*.__pycache__"]),  # trustscope.sql and the toy models: data
              *(f"{DASHBOARD}.{name}" for name in APP_PACKAGES)],
    package_dir={f"{DASHBOARD}.{name}": name.replace(".", "/") for name in APP_PACKAGES},
    cmdclass={"build_py": BuildPy},
)
