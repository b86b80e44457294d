"""The ``trustscope`` command line: one command per verb, help from the docstrings."""

from __future__ import annotations

import typer

from trustscope import __version__

app = typer.Typer(
    name="trustscope",
    help="Training-dynamics diagnostics for LLM reinforcement learning, with an integrated DPPO trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def version() -> None:
    """Print the trustscope version."""
    typer.echo(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
