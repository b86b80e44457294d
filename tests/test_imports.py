"""The package's import graph, read from the source: no module of ``trustscope/`` imports itself back, and the
read paths that must stay light do not import torch.

Every ``import`` statement counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:``. A function-level import only defers a circle to the first call; the layers are still
circular, and the lazy import is where an arrow runs back up. Importing ``a.b.c`` also runs ``a/b/__init__.py``,
so it is an edge to the package ``a.b`` too, except from inside that package (a package's ``__init__`` re-exporting
its own submodules is how packages are built). ``importlib.import_module`` by a string is not an import statement
and is not seen.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trustscope"

ALLOWED_EDGES: dict[tuple[str, str], str] = {}
"""Import edges whose circles are known and tolerated, each with the reason. Keep it empty."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name an import statement of ``name`` (the module at ``path``) names, resolved to absolute."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: the trustscope modules and packages its imports run}``."""
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for target in imported_names(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                run = ".".join(parts[:i])  # importing a.b.c runs a, a.b and a.b.c
                if run in MODULES and run != name and not name.startswith(run + "."):
                    edges.add(run)
        graph[name] = edges
    return graph


def path_back(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest import path from ``start`` to ``goal``, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while (node := came_from[node]) is not None:
                path.append(node)
            return path[::-1]
        for nxt in sorted(graph[node] - came_from.keys()):
            came_from[nxt] = node
            queue.append(nxt)
    return None


def test_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "trustscope.logger.writer" in graph["trustscope.logger.token_logger"]  # module level
    assert "trustscope.train.loop" in graph["trustscope.cli"]  # inside a function
    assert "trustscope.logger" in graph["trustscope.importers.writer"]  # a package, by `from pkg import name`


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of ``graph`` (less :data:`ALLOWED_EDGES`), once from each module on it."""
    graph = {name: edges - {b for a, b in ALLOWED_EDGES if a == name} for name, edges in graph.items()}
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            back = path_back(graph, target, module)
            if back:
                found.append(" -> ".join([module, *back]))
    return found


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared name down a layer):\n" + "\n".join(found)


def test_a_circle_is_found_and_the_catalogue_sits_above_its_torch_side():
    """``policy`` (torch) takes a rule object and knows no registry: it imports nothing of ``losses``, which imports
    it where a rule is called. An arrow back, as ``policy`` importing the registry would be, is a circle."""
    graph = import_graph()
    assert "trustscope.policy" in graph["trustscope.losses"] and "trustscope.losses" not in graph["trustscope.policy"]
    assert not [c for c in cycles(graph) if "trustscope.policy" in c.split(" -> ")]
    graph["trustscope.policy"].add("trustscope.losses")
    assert "trustscope.losses -> trustscope.policy -> trustscope.losses" in cycles(graph)


def test_allowed_edges_still_exist():
    graph = import_graph()
    stale = [edge for edge in ALLOWED_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not stale, f"remove these from ALLOWED_EDGES, the imports are gone: {stale}"


def test_read_paths_do_not_import_torch():
    # The CLI's startup, the logger (summaries=False logs without torch) and the importers' modules: torch takes
    # seconds to import and is only needed by the rules, the trainer and .pt files.
    light = ["trustscope.cli", "trustscope.logger", "trustscope.divergence_np", "trustscope.importers",
             *(name for name in MODULES if name.startswith("trustscope.importers."))]
    code = f"import sys\nfor name in {light!r}:\n    __import__(name)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
