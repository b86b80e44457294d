"""The docs are part of the product: the README's commands run in CI, and every public name is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def setup_commands() -> list[str]:
    """The commands of the first fenced block in the README, comments stripped."""
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", README, re.S)
    assert block, "README.md has no fenced code block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_readme_starts_with_exactly_two_setup_commands():
    before_block = README.split("```", 1)[0]
    assert "## " not in before_block.split("\n", 1)[1], "the set-up block must come before any section"
    assert len(setup_commands()) == 2


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = setup_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_every_loss_rule_is_documented():
    from trustscope.losses import list_losses

    missing = [name for name in list_losses() if f"`{name}`" not in DOCS]
    assert not missing, f"loss rules missing from README.md/docs: {missing}"


def test_every_cli_command_is_documented():
    from trustscope.cli import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    missing = [n for n in names if f"trustscope {n}" not in README]
    assert not missing, f"CLI commands missing from README.md: {missing}"


@pytest.mark.parametrize("kind", ["views", "macros"])
def test_every_sql_object_is_documented(kind):
    names = sorted(p.stem for p in (ROOT / "trustscope" / "sql" / kind).glob("*.sql"))
    missing = [n for n in names if f"`{n}`" not in DOCS and f"`{n}(" not in DOCS]
    assert not missing, f"SQL {kind} missing from README.md/docs: {missing}"


@pytest.mark.parametrize("doc", ["README.md", "docs/sql.md"])
def test_rule_tables_are_the_registry(doc):
    """The rule tables of README.md and docs/sql.md are the catalogue the registry renders, rule for rule."""
    from trustscope.losses import catalogue_markdown

    text = (ROOT / doc).read_text()
    found = re.search(r"<!-- rule catalogue: start -->\n(.*?)<!-- rule catalogue: end -->", text, re.S)
    assert found, f"{doc} has no rule catalogue block"
    assert found.group(1) == catalogue_markdown(), (
        f"{doc}'s rule table differs from the registry; paste the output of "
        "python -c 'from trustscope.losses import catalogue_markdown; print(catalogue_markdown(), end=\"\")'")


ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def test_architecture_names_every_module_page_sql_directory_and_command():
    from trustscope.cli import app

    package = ROOT / "trustscope"
    modules = [p for p in package.iterdir() if (p.suffix == ".py" and p.stem != "__init__")
               or (p.is_dir() and (p / "__init__.py").exists())]
    names = [f"trustscope/{p.name}{'/' if p.is_dir() else ''}" for p in modules]
    names += [f"trustscope/sql/{p.name}/" for p in (package / "sql").iterdir() if p.is_dir()]
    names += [f"app/views/{p.name}" for p in (ROOT / "app" / "views").glob("*.py") if p.stem != "__init__"]
    names += [f"trustscope {c.name or c.callback.__name__}" for c in app.registered_commands]
    missing = [n for n in names if f"`{n}" not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md does not mention: {missing}"
