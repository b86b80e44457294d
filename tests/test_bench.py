"""The benchmark runner: it lists every benchmark module, stores a run's result with the machine it ran on, and
refuses what it cannot run naming it; docs/performance.md's generated figures are the stored results."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import runner

ROOT = Path(__file__).resolve().parents[1]
TINY = '''"""A tiny benchmark for the runner's own test.

More text that is not the description.
"""

import argparse

QUICK = ["--n", "3"]


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int)
    n = parser.parse_args().n
    print(f"summed {n} numbers")
    return {"total": sum(range(n)), "parts": {"n": n}}
'''


def test_the_runner_lists_every_bench_module():
    listed = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    names = [line.split()[0] for line in listed]
    modules = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))
    assert names == modules and len(names) >= 30
    for line, bench in zip(listed, runner.benchmarks().values(), strict=True):
        assert bench.description in line and bool(bench.quick) == (" quick " in line)


def test_a_quick_run_stores_the_machine_the_commit_and_the_figures(tmp_path, monkeypatch):
    (tmp_path / "tinybench.py").write_text(TINY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    bench = runner._declarations(tmp_path / "tinybench.py")
    assert bench.description == "A tiny benchmark for the runner's own test." and bench.quick == ("--n", "3")
    bench = runner.Benchmark("tiny", "tinybench", bench.description, bench.quick)
    path = runner.run_one(bench, ["--n", "5"], quick=True, results=tmp_path / "results")
    record = json.loads(path.read_text())
    assert path == tmp_path / "results" / "tiny.json"
    assert record["figures"] == {"total": 10, "parts": {"n": 5}}  # the later --n wins over QUICK's
    assert record["args"] == ["--n", "3", "--n", "5"] and record["quick"] is True
    assert "summed 5 numbers" in record["output"]
    machine = record["machine"]
    assert machine["cpus"] >= 1 and machine["cpu"] and machine["python"] and len(machine["load_average"]) == 3
    assert len(record["load_average_end"]) == 3 and record["wall_s"] > 0
    assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool) and record["date"].endswith("Z")


def test_a_failing_benchmark_stores_nothing_and_an_unknown_one_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "tinybench.py").write_text(TINY.replace('print(f"summed', 'raise ValueError(f"bad'))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    bench = runner.Benchmark("tiny", "tinybench", "tiny", ("--n", "3"))
    with pytest.raises(SystemExit, match="'tiny' exited 1; nothing stored"):
        runner.run_one(bench, [], quick=True, results=tmp_path / "results")
    assert not (tmp_path / "results" / "tiny.json").exists()
    with pytest.raises(SystemExit, match="declares no QUICK"):
        runner.run_one(runner.Benchmark("slow", "tinybench", "slow", None), [], quick=True, results=tmp_path)
    with pytest.raises(SystemExit, match=r"unknown benchmark\(s\) 'nope'; known: .*cli"):
        runner.main(["run", "nope"])


def test_the_generated_figures_show_each_stored_result(tmp_path):
    record = {"name": "cli", "module": "bench.bench_cli", "args": ["--repeat", "1"], "quick": True,
              "date": "2026-01-01T00:00:00Z", "commit": "a" * 40, "dirty": False, "wall_s": 3.2,
              "machine": {"cpu": "CPU X", "cpus": 2, "load_average": [0.5, 0.4, 0.3]}, "load_average_end": [0.7],
              "figures": {"sql": {"median_s": 0.25, "x_duckdb": 2.5}}, "output": ""}
    (tmp_path / "cli.json").write_text(json.dumps(record))
    text = runner.figures_markdown(tmp_path)
    assert "#### cli (--quick)" in text and "`python -m bench run cli --quick`" in text
    assert "2 x CPU X, load average 0.5 at the start, 0.7 at the end" in text and "commit aaaaaaaaaa" in text
    assert "| sql.median_s | 0.25 |" in text and "| sql.x_duckdb | 2.5 |" in text
    assert "not re-measured here): `dashboard`, " in text and "`cli`" not in text.split("No stored result")[1]
    printed = {**record, "figures": None, "output": "a table it printed\n"}
    (tmp_path / "cli.json").write_text(json.dumps(printed))
    assert "```text\na table it printed\n```" in runner.figures_markdown(tmp_path)


def test_the_performance_page_shows_the_stored_results():
    found = runner.documented_figures()
    assert found is not None, "docs/performance.md has no '<!-- benchmark figures: start -->' block"
    assert found == runner.figures_markdown(), "docs/performance.md differs from bench/results/: run " \
        ".venv/bin/python -m bench docs --write and commit the result"
    assert found.count("#### ") == len(list(runner.RESULTS.glob("*.json"))) > 0



def _own_returns(function: ast.FunctionDef) -> list[ast.Return]:
    """The return statements of ``function`` itself, not of the functions, lambdas and classes defined in it."""
    found, todo = [], list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _changes_sys_path(tree: ast.Module) -> bool:
    """Whether the module names ``sys.path`` (to insert into it, append to it or replace it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
    return False


def test_every_benchmark_returns_its_figures_and_leaves_sys_path_alone():
    """Read from the sources, nothing run: each bench_*.py's main() returns a value on every return (its figures,
    which the runner stores and docs/performance.md shows), and no module under bench/ changes ``sys.path`` (a
    helper a benchmark needs lives in bench/, not in tests/)."""
    without_figures, touching_sys_path = [], []
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if _changes_sys_path(tree):
            touching_sys_path.append(path.name)
        if not path.stem.startswith(runner.PREFIX):
            continue
        [main] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        returns = _own_returns(main)
        if not returns or any(r.value is None for r in returns):
            without_figures.append(path.stem)
    assert not without_figures, f"main() returns no figures (on some path at least) in: {', '.join(without_figures)}"
    assert not touching_sys_path, f"sys.path changed in: {', '.join(touching_sys_path)}"
