"""The ``trustscope`` console script: one command a process, started and ended as cheaply as it can be.

``trustscope sql`` runs without importing typer (:mod:`trustscope.sql_command`); every other command goes
through :mod:`trustscope.cli`. The read-only commands end without the interpreter's teardown once their output is
flushed and the exit handlers have run (unloading DuckDB and pyarrow takes 0.15-0.2 s; ``docs/performance.md``).
"""

from __future__ import annotations

import os
import sys

READ_ONLY = ("sql", "report", "validate", "doctor")
"""Commands that write nothing but their output."""


def main() -> None:
    """Run the command of ``sys.argv`` and exit with its status."""
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        if command == "sql":
            from trustscope import sql_command

            sql_command.ONE_SHOT = True  # this process runs the one command: its SQL worker may be forked
            sql_command.sql.main(args=sys.argv[2:], prog_name="trustscope sql")
        else:
            from trustscope.cli import app

            app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except ModuleNotFoundError as exc:  # a library an install extra brings (trustscope.extras), else a bug
        from trustscope import extras

        if extras.extra_for(exc.name) is None:
            raise
        print(extras.message(exc.name, f"trustscope {command}"), file=sys.stderr)
        code = 2
    if command in READ_ONLY:
        import atexit

        atexit._run_exitfuncs()  # the exit handlers still run (a LogDB's finaliser on an error path, say)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
