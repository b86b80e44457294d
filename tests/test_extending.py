"""docs/extending.md against the code: every file a recipe names exists, every name it imports is there, every
keyword it passes is a parameter of the function it calls, and the recipes that declare something, run, put it in
their registry (a rule, an importer, a doctor check, a page, a column, a dimension; the toy world's recipe runs in
``tests/test_worlds.py``). Every mask family of the catalogue has the four pieces the mask-family recipe lists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "extending.md").read_text()


def sections() -> dict[str, str]:
    """``"## heading" -> its text``."""
    parts = re.split(r"^## (.+)$", PAGE, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def code(section: str) -> list[str]:
    """The ``python`` blocks of one section."""
    return re.findall(r"```python\n(.*?)```", sections()[section], flags=re.S)


def all_code() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)


def test_the_page_has_a_recipe_for_every_extension_point():
    assert {"A trust-region rule", "A mask family", "A per-token column", "A summary dimension", "An importer",
            "A doctor check", "A dashboard page", "A toy world"} <= set(sections()), list(sections())


def test_every_path_a_recipe_names_exists():
    paths = set(re.findall(r"`((?:trustscope|app|tests)/[\w/<>.\-]*)`", PAGE))
    assert len(paths) > 15
    missing = [p for p in sorted(paths) if not list(ROOT.glob(re.sub(r"<[^>]*>", "*", p).rstrip("/")))]
    assert not missing, f"docs/extending.md names paths that do not exist: {missing}"


def test_every_recipe_parses_and_every_name_it_imports_exists():
    for block in all_code():
        tree = ast.parse(block)  # a recipe is Python as written (a fragment, such as a table entry, too)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trustscope":
                module = importlib.import_module(node.module)
                absent = [a.name for a in node.names if not hasattr(module, a.name)
                          and importlib.util.find_spec(f"{node.module}.{a.name}") is None]  # a name or a submodule
                assert not absent, f"{node.module} has no {absent} (docs/extending.md)"


CALLED = {
    "register_loss": "trustscope.losses", "SqlMask": "trustscope.masks.family", "Param": "trustscope.losses",
    "Threshold": "trustscope.masks.family", "delta_threshold": "trustscope.masks.family",
    "register_importer": "trustscope.importers.base", "ImportedRun": "trustscope.importers.base",
    "register_check": "trustscope.doctor", "Judgement": "trustscope.doctor",
    "register_family": "trustscope.train.worlds", "Family": "trustscope.train.worlds",
    "Column": "trustscope.columns", "Dimension": "trustscope.columns", "Check": "trustscope.columns",
    "Page": "app.pages",
}
"""The declarations the recipes call, and where each lives."""


def signature(name: str) -> inspect.Signature:
    return inspect.signature(getattr(importlib.import_module(CALLED[name]), name))


def test_every_keyword_a_recipe_passes_is_a_parameter():
    seen = set()
    for block in all_code():
        for node in ast.walk(ast.parse(block)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLED):
                continue
            seen.add(node.func.id)
            params = signature(node.func.id).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue  # register_loss: the rule's own parameters
            unknown = [k.arg for k in node.keywords if k.arg not in params]
            assert not unknown, f"{node.func.id} takes no {unknown} (docs/extending.md)"
            positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            assert len(node.args) <= len(positional), f"{node.func.id}: {len(node.args)} positional arguments"
    assert {"register_loss", "register_importer", "register_check", "register_family", "SqlMask", "Column",
            "Dimension", "Page"} <= seen


def test_every_keyword_the_importer_recipe_names_is_a_parameter_of_register_importer():
    named = set(re.findall(r"`(\w+)=`", sections()["An importer"]))
    assert named >= {"options", "steps", "combine", "finished"}
    assert named <= set(signature("register_importer").parameters)


def test_every_mask_family_has_the_four_pieces_of_the_recipe():
    from trustscope.losses import BUILTIN_RULES, get_loss, list_losses
    from trustscope.masks import FAMILIES, FAMILY_DIR

    families = {}
    for rule in map(get_loss, list_losses()):
        if rule.sql is not None:
            families.setdefault(rule.sql.family, []).append(rule)
    assert len(families) >= 5
    for family, rules in families.items():
        assert family in FAMILIES, family  # its module: the torch mask and score beside the SQL
        assert (FAMILY_DIR / f"{family}_blocks.sql").is_file(), family  # the SQL mask
        for rule in rules:
            if family != "none":
                assert rule.mask is not None or rule.loss is not None, rule.name  # the torch side
            if rule.name in BUILTIN_RULES and rule.mask is not None:
                assert rule.mask.__module__ == f"trustscope.masks.{family}", rule.name  # beside its SQL
            threshold = rule.sql.threshold
            if threshold is not None:
                assert callable(threshold.score), rule.name  # the score function
                assert (FAMILY_DIR / f"{family}_score.sql").is_file(), family  # the SQL score
                assert threshold.score.__module__ == f"trustscope.masks.{family}", rule.name  # in one place


def test_the_column_and_dimension_recipes_declare_what_the_registry_takes():
    import numpy as np
    import pyarrow as pa

    from trustscope import columns as C

    (column,) = code("A per-token column")
    made = eval(column.strip().rstrip(","), {"pa": pa, "np": np, "Column": C.Column, "Check": C.Check})
    assert isinstance(made, C.Column) and made.given in C.GIVEN and made.check.kind in C.CHECKS
    assert made.since == C.table_versions()["tokens"] + 1, "the recipe's column comes with the next tokens version"
    assert made.name not in {c.name for c in C.TOKEN_COLUMNS}
    (dimension,) = code("A summary dimension")
    made = eval(dimension.strip().rstrip(","), {"np": np, "Dimension": C.Dimension})
    assert isinstance(made, C.Dimension) and set(made.needs) <= {c.name for c in C.TOKEN_COLUMNS}
    assert made.bucket({"pos": np.arange(200)}, 0).tolist()[::64] == [0, 1, 2, 3]
    assert type(C.DIMENSIONS) is tuple and all(isinstance(d, C.Dimension) for d in C.DIMENSIONS)


def test_the_page_recipe_is_an_entry_of_the_page_table():
    from app import pages

    (entry,) = code("A dashboard page")
    made = eval(entry.strip().rstrip(","), vars(pages))
    assert isinstance(made, pages.Page) and made.section in {p.section for p in pages.PAGES}


@pytest.fixture
def doctor_sql(tmp_path):
    (tmp_path / "my_check.sql").write_text("select 1 as n_bad")
    return tmp_path


def test_the_rule_importer_and_doctor_recipes_run_and_register(doctor_sql):
    """In a fresh process (the registries stay as they are here): each recipe's code as the page writes it."""
    rule, importer, check = code("A trust-region rule")[0], code("An importer")[0], code("A doctor check")[0]
    script = "\n".join([
        "import trustscope.doctor as doctor",
        f"doctor.DOCTOR_SQL_DIR = __import__('pathlib').Path({str(doctor_sql)!r})",
        "ns = {}",
        f"exec({rule!r}, ns)",
        f"exec({importer!r}, ns)",
        f"exec({check!r}, ns)",
        "from trustscope.losses import get_loss",
        "from trustscope.importers import IMPORTERS",
        "assert get_loss('dppo_tv_010').params['delta'].default == 0.1, 'rule'",
        "assert get_loss('ppo_wide').defaults['eps_high'] == 0.4, 'preset'",
        "assert IMPORTERS['my-framework'].read is ns['read'], 'importer'",
        "assert doctor.CHECKS['my_check'].judge is ns['judge_my_check'], 'check'",
        "print('registered')",
    ])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "registered", out.stderr[-3000:]
