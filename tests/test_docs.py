"""The docs are part of the product: the README's commands run in CI, the reference pages are generated from the
code and checked equal, and the docs site builds with no broken link and no page left out.

The generated blocks (the CLI reference in docs/cli.md, the rule table in docs/rules.md) are rewritten with

    .venv/bin/python tests/test_docs.py --write
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS_DIR = ROOT / "docs"
SETUP = ["bash scripts/demo.sh", "bash scripts/test.sh"]
README_MAX_BYTES = 10_000
BLOCK = "<!-- {name}: start -->\n(.*?)<!-- {name}: end -->"
REGENERATE = "run .venv/bin/python tests/test_docs.py --write and commit the result"


def doc(name: str) -> str:
    return (DOCS_DIR / name).read_text()


def setup_commands() -> list[str]:
    """The commands of the first fenced block in the README, comments stripped."""
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", README, re.S)
    assert block, "README.md has no fenced code block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def cli_commands() -> list[str]:
    """Every command of ``trustscope.cli.app``, in the order ``trustscope --help`` lists them (``train`` included,
    though it is built on demand)."""
    import click
    import typer.main

    from trustscope.cli import app

    group = typer.main.get_command(app)
    return group.list_commands(click.Context(group, info_name="trustscope"))


def _cell(text: str) -> str:
    """One table cell of help text: one line, pipes escaped, ``<`` and ``>`` outside code spans escaped."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _epilog(cmd, ctx) -> str:
    """The text a command's help ends with. A command may fill in its help when the help is asked for (``doctor``
    lists the registered checks, ``import`` the formats), so the help is rendered first and its output dropped."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cmd.get_help(ctx)
    return (cmd.epilog or "").strip()


def cli_markdown() -> str:
    """docs/cli.md's generated block: a table of every command with its help's first paragraph, then per command
    its whole help, its usage and every argument and option with its help and default."""
    import click
    import typer.main

    from trustscope.cli import app

    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="trustscope")
    names = group.list_commands(ctx)
    # resolve_command gives each command as it runs (train's options are built only then)
    commands = {name: group.resolve_command(ctx, [name])[1] for name in names}
    epilogs = {name: _epilog(cmd, click.Context(cmd, info_name=name, parent=ctx)) for name, cmd in commands.items()}
    out = ["| command | what it does |", "|---|---|"]
    for name, cmd in commands.items():
        first = (cmd.help or "").strip().split("\n\n")[0]
        out.append(f"| [`trustscope {name}`](#trustscope-{name}) | {_cell(first)} |")
    for name, cmd in commands.items():
        sub = click.Context(cmd, info_name=name, parent=ctx)
        out += ["", f"## `trustscope {name}`", ""]
        for paragraph in (cmd.help or "").strip().split("\n\n"):
            out += [_cell(paragraph), ""]
        if epilogs[name]:
            out += [_cell(epilogs[name]), ""]
        out += ["```", f"trustscope {name} {' '.join(cmd.collect_usage_pieces(sub))}", "```"]
        rows = [record for record in (p.get_help_record(sub) for p in cmd.params) if record]
        if rows:
            out += ["", "| argument or option | meaning |", "|---|---|"]
            out += [f"| `{' '.join(opt.split())}` | {_cell(help_)} |" for opt, help_ in rows]
    return "\n".join(out) + "\n"


def generated_blocks() -> dict[tuple[str, str], str]:
    """(docs page, block name) -> the text the block must hold."""
    from trustscope.columns import TABLE_COLUMNS, columns_markdown, dimensions_markdown
    from trustscope.losses import catalogue_markdown
    from trustscope.train.worlds import world_table

    return {("rules.md", "rule catalogue"): catalogue_markdown(), ("cli.md", "cli reference"): cli_markdown(),
            **{("logging.md", f"{table} columns"): columns_markdown(table) for table in TABLE_COLUMNS},
            ("logging.md", "summary dimensions"): dimensions_markdown(), ("train.md", "toy worlds"): world_table()}


def block(text: str, name: str) -> str | None:
    found = re.search(BLOCK.format(name=name), text, re.S)
    return found.group(1) if found else None


# ---------------------------------------------------------------------------------------------------------------
# the README: one screen, the two commands CI runs, every command


def test_readme_starts_with_exactly_the_two_setup_commands():
    before_block = README.split("```", 1)[0]
    assert "## " not in before_block.split("\n", 1)[1], "the set-up block must come before any section"
    assert setup_commands() == SETUP


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = setup_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_fits_on_one_screen():
    size = len(README.encode())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; keep it under {README_MAX_BYTES} (move the rest to docs/)"


def test_every_cli_command_is_in_the_readme():
    missing = [n for n in cli_commands() if f"trustscope {n}`" not in README]
    assert not missing, f"CLI commands missing from README.md's command table: {missing}"


def test_readme_links_and_images_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://|mailto:", t)]
    assert any(t.startswith("docs/img/") for t in local), "README.md shows no dashboard screenshot"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


# ---------------------------------------------------------------------------------------------------------------
# reference pages generated from the code


@pytest.mark.parametrize(("page", "name"), [("rules.md", "rule catalogue"), ("cli.md", "cli reference"),
                                           *(("logging.md", f"{t} columns") for t in
                                             ("tokens", "samples", "steps", "summaries", "vocab")),
                                           ("logging.md", "summary dimensions")])
def test_generated_reference_is_up_to_date(page, name):
    found = block(doc(page), name)
    assert found is not None, f"docs/{page} has no '{name}' block"
    assert found == generated_blocks()[(page, name)], f"docs/{page}'s {name} differs from the code; {REGENERATE}"


def test_every_loss_rule_is_in_the_rule_reference():
    from trustscope.losses import list_losses

    rules = doc("rules.md")
    missing = [name for name in list_losses() if f"`{name}`" not in rules]
    assert not missing, f"loss rules missing from docs/rules.md: {missing}"


def test_the_rule_table_lives_in_one_place():
    copies = [p.name for p in DOCS_DIR.glob("*.md") if p.name != "rules.md" and "rule catalogue: start" in p.read_text()]
    copies += ["README.md"] * ("rule catalogue: start" in README)
    assert not copies, f"copies of the rule table outside docs/rules.md (link to it instead): {copies}"


@pytest.mark.parametrize("kind", ["views", "macros"])
def test_every_sql_object_is_in_the_sql_reference(kind):
    sql = doc("sql.md")
    names = sorted(p.stem for p in (ROOT / "trustscope" / "sql" / kind).glob("*.sql"))
    missing = [n for n in names if f"`{n}`" not in sql and f"`{n}(" not in sql]
    assert not missing, f"SQL {kind} missing from docs/sql.md: {missing}"


def test_every_log_column_is_in_the_schema_reference():
    """docs/logging.md's table of each Parquet table lists every column with its Arrow type and nullability."""
    from trustscope.runformat.layout import SCHEMAS

    logging_md = doc("logging.md")
    missing = []
    for table, schema in SCHEMAS.items():
        for field in schema:
            row = f"| `{field.name}` | `{field.type}` | {'yes' if field.nullable else 'no'} |"
            if row not in logging_md:
                missing.append(f"{table}.{field.name} ({row})")
    assert not missing, f"docs/logging.md's schema tables lack (or disagree on): {missing}"


def test_every_dashboard_page_is_in_the_dashboard_guide():
    """docs/dashboard.md describes every page of the dashboard's page table, under its menu title."""
    pages = pytest.importorskip("app.pages")
    dashboard = doc("dashboard.md")
    missing = [p.title for p in pages.PAGES if f"- **{p.title}**" not in dashboard]
    assert not missing, f"dashboard pages missing from docs/dashboard.md's page list: {missing}"


def test_every_import_format_is_in_the_importers_guide():
    from trustscope import importers

    formats = getattr(importers, "IMPORTERS", None) or importers.FORMATS
    guide = doc("importers.md")
    missing = [name for name in formats if f"| `{name}` |" not in guide]
    assert not missing, f"import formats missing from docs/importers.md's format table: {missing}"


def test_every_doctor_check_is_in_the_doctor_guide():
    doctor = pytest.importorskip("trustscope.doctor")
    checks = getattr(doctor, "CHECKS", None)
    if checks is None:
        pytest.skip("trustscope.doctor has no CHECKS registry")
    guide = doc("doctor.md")
    missing = [name for name in checks if f"| `{name}` |" not in guide]
    assert not missing, f"doctor checks missing from docs/doctor.md's table of checks: {missing}"


ARCHITECTURE = doc("architecture.md")


def test_architecture_names_every_module_page_sql_directory_and_command():
    package = ROOT / "trustscope"
    modules = [p for p in package.iterdir() if (p.suffix == ".py" and p.stem != "__init__")
               or (p.is_dir() and (p / "__init__.py").exists())]
    names = [f"trustscope/{p.name}{'/' if p.is_dir() else ''}" for p in modules]
    names += [f"trustscope/sql/{p.name}/" for p in (package / "sql").iterdir() if p.is_dir()]
    names += [f"app/views/{p.name}" for p in (ROOT / "app" / "views").glob("*.py") if p.stem != "__init__"]
    names += [f"trustscope {name}" for name in cli_commands()]
    missing = [n for n in names if f"`{n}" not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md does not mention: {missing}"


# ---------------------------------------------------------------------------------------------------------------
# the docs site


def test_docs_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav, an API reference that does not
    resolve, each fails the build (mkdocs.yml's ``validation`` turns them into warnings, --strict into errors)."""
    pytest.importorskip("mkdocs", reason="the docs tools come with the test extra: pip install -e '.[test]'")
    pytest.importorskip("mkdocstrings")
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"})
    problems = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [result.stderr[-3000:]])
    assert (tmp_path / "site" / "index.html").exists()


def write_generated_blocks() -> list[str]:
    """Rewrite every generated block in place; the pages changed."""
    changed = []
    for (page, name), text in generated_blocks().items():
        path = DOCS_DIR / page
        old = path.read_text()
        if block(old, name) is None:
            raise SystemExit(f"docs/{page} has no '<!-- {name}: start -->' ... '<!-- {name}: end -->' block")
        replacement = f"<!-- {name}: start -->\n{text}<!-- {name}: end -->"
        new = re.sub(BLOCK.format(name=name), lambda _, r=replacement: r, old, flags=re.S)
        if new != old:
            path.write_text(new)
            changed.append(f"docs/{page}")
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    print("rewrote:", ", ".join(write_generated_blocks()) or "nothing (up to date)")
