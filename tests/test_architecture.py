"""docs/architecture.md's module map names every module of ``trustscope/``, subpackages' modules included: a module
added, moved or renamed without its line in the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trustscope"
MAP = (ROOT / "docs" / "architecture.md").read_text()

ROWS = {m.group(1): m.group(0) for m in re.finditer(r"^\| `trustscope/([^`]*/)` \|.*$", MAP, flags=re.M)}
"""The map's package rows: ``"runformat/" -> the row``."""


def modules() -> list[Path]:
    """Every module of the package, relative to ``trustscope/`` (a package's ``__init__.py`` is its package)."""
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "__catalogue__" not in p.parts)


def named(rel: str) -> bool:
    """``a/b/c.py`` (or the package ``a/b/``) is named as ``trustscope/a/b/c.py`` anywhere in the page, or as
    ``b/c.py`` in the row of ``trustscope/a/``, or as ``c.py`` in the row of ``trustscope/a/b/``."""
    if f"`trustscope/{rel}`" in MAP:
        return True
    parts = rel.rstrip("/").split("/")
    tail = "/" if rel.endswith("/") else ""
    for i in range(1, len(parts)):
        row = ROWS.get("/".join(parts[:i]) + "/")
        if row is not None and f"`{'/'.join(parts[i:])}{tail}`" in row:
            return True
    return False


def test_the_map_names_every_module_and_package():
    packages = {p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")} - {"./"}
    missing = [f"trustscope/{m}" for m in [*(m.as_posix() for m in modules()), *sorted(packages)] if not named(m)]
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"


def test_the_check_sees_a_module_left_out():
    assert named("runformat/swap.py") and named("policy.py") and named("integrations/verl/actor.py")
    assert named("train/toy_models/") and named("runformat/")
    assert not named("runformat/no_such_module.py") and not named("no_such_module.py")
    assert not named("train/no_such_package/")
