"""The benchmark runner (``python -m bench``).

    python -m bench list                        # every benchmark: name, quick run or not, description
    python -m bench run NAME... [--quick]       # each in a fresh process; results in bench/results/NAME.json
    python -m bench run NAME -- --repeat 3      # arguments after -- go to the benchmark
    python -m bench docs [--write]              # docs/performance.md's generated figures from bench/results/

A benchmark is a module ``bench/bench_<name>.py``: its name is ``<name>``, its description the first line of its
docstring, ``QUICK`` (a module-level list of strings, optional) the arguments of its small run. The module is not
imported by ``list``: the declarations are read from its source.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
PREFIX = "bench_"
PERFORMANCE = common.ROOT / "docs" / "performance.md"
BLOCK_NAME = "benchmark figures"
BLOCK = "<!-- {name}: start -->\n(.*?)<!-- {name}: end -->"
OUTPUT_TAIL = 6000


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    description: str
    quick: tuple[str, ...] | None


def _declarations(path: Path) -> Benchmark:
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree)
    if not doc:
        raise SystemExit(f"{path.relative_to(common.ROOT)} has no docstring: its first line is its description")
    quick = None
    has_main = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "QUICK" for t in node.targets):
            quick = ast.literal_eval(node.value)
            if not (isinstance(quick, list) and all(isinstance(a, str) for a in quick)):
                raise SystemExit(f"{path.name}: QUICK must be a list of strings, got {quick!r}")
        has_main |= isinstance(node, ast.FunctionDef) and node.name == "main"
    if not has_main:
        raise SystemExit(f"{path.relative_to(common.ROOT)} has no main(): every benchmark module needs one")
    stem = path.stem
    return Benchmark(name=stem[len(PREFIX):], module=f"bench.{stem}", description=doc.split("\n\n")[0].replace("\n", " "),
                     quick=tuple(quick) if quick is not None else None)


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark module under bench/, by name."""
    found = [_declarations(p) for p in sorted(BENCH_DIR.glob(f"{PREFIX}*.py"))]
    return {b.name: b for b in found}


def _child(module: str, out: str, args: list[str]) -> None:
    """In the fresh process: import the benchmark, run its main() with ``args`` as its command line, write what
    it returned to ``out``."""
    loaded = importlib.import_module(module)
    sys.argv = [loaded.__file__, *args]
    figures = loaded.main()
    Path(out).write_text(json.dumps({"figures": figures}, default=str))


def run_one(bench: Benchmark, args: list[str], quick: bool, results: Path) -> Path:
    """Run ``bench`` in a fresh process (its output passed through and kept), store the result; the path."""
    if quick:
        if bench.quick is None:
            raise SystemExit(f"benchmark {bench.name!r} declares no QUICK arguments: run it without --quick")
        args = [*bench.quick, *args]
    results.mkdir(parents=True, exist_ok=True)
    record = {"name": bench.name, "module": bench.module, "args": args, "quick": quick, "date": common.now(),
              **common.git_commit(), "machine": common.machine()}
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "bench.runner", "_child", bench.module, str(out), *args]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
        returncode = proc.wait()
        record["wall_s"] = round(time.perf_counter() - start, 3)
        record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        if returncode != 0:
            raise SystemExit(f"benchmark {bench.name!r} exited {returncode}; nothing stored")
        figures = json.loads(out.read_text())["figures"] if out.exists() else None
    record["figures"] = figures
    record["output"] = "".join(lines)[-OUTPUT_TAIL:]
    path = results / f"{bench.name}.json"
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    tmp_path.replace(path)
    return path


def _flat(value, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), value)]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value[:8]) + (f", ... ({len(value)})" if len(value) > 8 else "")
    return str(value).replace("|", "\\|")


def figures_markdown(results: Path = RESULTS) -> str:
    """The generated block of docs/performance.md: one section a stored result, the machine and commit it ran on,
    its figures (the dictionary its main() returned, or the table it printed)."""
    known = benchmarks()
    parts = []
    for path in sorted(results.glob("*.json")):
        r = json.loads(path.read_text())
        m = r["machine"]
        title = r["name"] + (" (--quick)" if r["quick"] else "")
        description = known[r["name"]].description if r["name"] in known else "(no such benchmark any more)"
        cmd = " ".join(["python -m bench run", r["name"], *(["--quick"] if r["quick"] else [])]
                       + (["--", *r["args"][len(known[r['name']].quick or ()) if r["quick"] else 0:]]
                          if r["args"][len(known[r['name']].quick or ()) if r["quick"] else 0:] else []))
        parts.append(f"#### {title}\n\n{description}\n\n`{cmd}`: {r['date']}, commit {(r['commit'] or '?')[:10]}"
                     f"{' (with changes)' if r['dirty'] else ''}, {m['cpus']} x {m['cpu']}, load average "
                     f"{m['load_average'][0]} at the start, {r['load_average_end'][0]} at the end, {r['wall_s']:.0f} s.\n")
        if isinstance(r["figures"], dict) and r["figures"]:
            rows = _flat(r["figures"])
            parts.append("| figure | value |\n|---|---|\n" + "".join(f"| {k} | {_cell(v)} |\n" for k, v in rows))
        else:
            parts.append("```text\n" + r["output"].rstrip("\n") + "\n```\n")
    stored = {p.stem for p in results.glob("*.json")}
    missing = [name for name in known if name not in stored]
    if missing:
        parts.append("No stored result (their figures in the sections below stand as measured by the commands there, "
                     "not re-measured here): " + ", ".join(f"`{name}`" for name in missing) + ".\n")
    return "\n".join(parts)


def documented_figures(page: Path = PERFORMANCE) -> str | None:
    """The text of the generated block in ``page`` (docs/performance.md), or None when it has no such block."""
    found = re.search(BLOCK.format(name=BLOCK_NAME), page.read_text(), re.S)
    return found.group(1) if found else None


def _write_docs(check: bool) -> int:
    if documented_figures() is None:
        raise SystemExit(f"docs/performance.md has no '<!-- {BLOCK_NAME}: start -->' ... end block")
    new = figures_markdown()
    if check:
        current = documented_figures() == new
        print("docs/performance.md is current" if current else "docs/performance.md differs: python -m bench docs --write")
        return 0 if current else 1
    replacement = f"<!-- {BLOCK_NAME}: start -->\n{new}<!-- {BLOCK_NAME}: end -->"
    text = PERFORMANCE.read_text()
    PERFORMANCE.write_text(re.sub(BLOCK.format(name=BLOCK_NAME), lambda _: replacement, text, flags=re.S))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        _child(argv[1], argv[2], argv[3:])
        return 0
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every benchmark: name, whether it has a quick run, description")
    run = sub.add_parser("run", help="run benchmarks, each in a fresh process, and store their results")
    run.add_argument("names", nargs="+")
    run.add_argument("--quick", action="store_true", help="the small run each benchmark declares (QUICK)")
    run.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results go")
    docs = sub.add_parser("docs", help="docs/performance.md's generated figures from the stored results")
    docs.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    known = benchmarks()
    if args.command == "list":
        width = max(map(len, known))
        for b in known.values():
            print(f"{b.name:{width}s}  {'quick' if b.quick is not None else '     '}  {b.description}")
        return 0
    if args.command == "docs":
        return _write_docs(check=not args.write)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    for name in args.names:
        path = run_one(known[name], extra, args.quick, args.results)
        print(f"stored {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
