"""``trustscope sql``: the command a user times most, written on click alone.

typer, which builds the other commands, costs this one about 0.2 s a run (its import, and its parameter coercion,
which imports pydantic): more than the query. The console script (:mod:`trustscope.entry`) runs this command
without importing typer; ``trustscope --help`` lists it with the others (:class:`trustscope.cli.Commands`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import click

FORMATS = ("table", "csv", "json", "parquet")
ONE_SHOT = False
"""Set by the console script (:func:`trustscope.entry.main`), whose process runs this one command and has opened no
DuckDB connection when it starts: the SQL worker is then forked from it (see :func:`trustscope.sandbox.prewarm`);
run from elsewhere (a test's runner) it is spawned."""


def first_line(exc: BaseException) -> str:
    """An error's first line: DuckDB appends the failing SQL (views included) below it, which says nothing to a
    user and is not theirs to read."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def left_out(command: str, broken: dict[str, list[str]]) -> None:
    """Name on stderr each run a command leaves out, with its first problem."""
    for run_id, problems in broken.items():
        click.echo(f"trustscope {command}: run {run_id} left out, unreadable: {problems[0]}"
                   + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), err=True)


@click.command("sql", short_help="Run one read-only SQL query over a log directory (macros and views of "
                                 "trustscope/sql loaded).")
@click.argument("logdir", metavar="[LOGDIR]")
@click.argument("query", required=False, metavar="QUERY")  # one argument: the query, over the sample logs
@click.option("--format", "-f", "fmt", default="table", show_default=True, help="table, csv, json or parquet.")
@click.option("--out", "-o", type=click.Path(path_type=Path), default=None,
              help="Write the result here instead of stdout.")
@click.option("--max-rows", type=int, default=10_000, show_default=True,
              help="Rows returned at most (the output says when rows were cut).")
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds before the query is interrupted.")
@click.option("--rule", "rules", multiple=True, metavar="NAME:param=value",
              help="Evaluate a rule at other parameters (repeatable): NAME:param=value,... or NAME@VALUE (its "
                   "scalar threshold); a run's own rule stays at the parameters it trained with.")
def sql(logdir: str, query: str | None, fmt: str, out: Path | None, max_rows: int, timeout: float,
        rules: tuple[str, ...] = ()) -> None:
    """Run one read-only SQL query over a log directory (macros and views of trustscope/sql loaded).

    LOGDIR is a log directory, one run directory inside it, or an s3://bucket/prefix (default: the sample logs);
    QUERY one read-only SELECT over the views (tokens, step_summary, ...). A run with an unreadable file is left
    out (named on stderr); the others are queried.
    """
    from trustscope import sandbox

    if query is None:  # `trustscope sql QUERY`: over the sample logs
        from trustscope.paths import sample_logdir

        logdir, query = str(sample_logdir()), logdir
    sandbox.prewarm(fork=ONE_SHOT)  # the SQL worker gets ready while this process opens the log directory
    from trustscope.db import NoRunsFound, QueryRefused, QueryStopped, connect_readable
    from trustscope.results import preload, write_result
    from trustscope.runformat.retry import StorageError

    if fmt not in FORMATS:
        click.echo(f"trustscope sql: --format {fmt!r} is not one of {', '.join(FORMATS)}", err=True)
        raise SystemExit(2)  # SystemExit, not click's Exit: typer's group runs its own copy of click
    if fmt == "parquet" and out is None:
        click.echo("trustscope sql: --format parquet needs --out FILE", err=True)
        raise SystemExit(2)  # SystemExit, not click's Exit: typer's group runs its own copy of click
    rule_params = None
    if rules:  # the rule catalogue is imported only when asked for
        from trustscope.rule_settings import rule_params_of

        try:
            rule_params = rule_params_of(rules)
        except ValueError as exc:
            click.echo(f"trustscope sql: --rule: {exc}", err=True)
            raise SystemExit(2) from exc
    try:
        db, broken = connect_readable(logdir, max_rows=max_rows, timeout_s=timeout, rule_params=rule_params)
        left_out("sql", broken)
        with db:
            # the output's libraries load while this process waits on the worker's answer (rich: 30 ms)
            threading.Thread(target=preload, args=(fmt,), daemon=True, name="trustscope-sql-output").start()
            result = db.sql(query)
    except (QueryRefused, QueryStopped, FileNotFoundError, NoRunsFound, StorageError, ValueError) as exc:
        click.echo(f"trustscope sql: {first_line(exc)}", err=True)
        raise SystemExit(1) from exc
    except Exception as exc:  # a DuckDB error in the user's SQL: say it plainly
        click.echo(f"trustscope sql: {type(exc).__name__}: {first_line(exc)}", err=True)
        raise SystemExit(1) from exc
    write_result(result, fmt, out)
