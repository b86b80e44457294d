"""The ``trustscope`` command line: one command per verb, help from the docstrings."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import click
import typer
import typer.core

from trustscope import __version__
from trustscope.rule_settings import RULE_OPTION_HELP, SETTINGS_ENV, check_budget, rule_params_of
from trustscope.sql_command import first_line, left_out
from trustscope.sql_command import sql as sql_command

TRAIN_HELP = """Train with DPPO (or any registered rule) on the toy world or a Hugging Face model, logging every token.

Every option is a TrainConfig field, its help the field's docstring; options override the --config file's values.
"""
METAVARS = {int: "INTEGER", float: "NUMBER", str: "TEXT"}


def train_command() -> click.Command:
    """``trustscope train``: one option per :class:`~trustscope.train.config.TrainConfig` field, generated from the
    dataclass. Values are handed on as given (text, or true/false for flags) and coerced once, by TrainConfig.
    Built when first asked for, since reading TrainConfig imports torch."""
    from trustscope.train.config import TrainConfig, field_docs

    docs, defaults = field_docs(), TrainConfig(run_id="x").to_dict()
    hints = typing.get_type_hints(TrainConfig)
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    params = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None, default=typer.Option(
            None, "--config", help="JSON or TOML file of TrainConfig fields.")),
        inspect.Parameter("list_options", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
            False, "--list-options", help="List every option with its default and exit.")),
    ]
    for name in fields:
        flag = "--" + name.replace("_", "-")
        default = "" if name == "run_id" else defaults[name]
        doc = f"{docs[name]} [default: {default!r}]"
        if hints[name] is bool:
            option = typer.Option(None, f"{flag}/--no-{flag[2:]}", help=doc, show_default=False)
            annotation: Any = bool | None
        else:
            metavar = METAVARS.get(hints[name], "JSON" if typing.get_origin(hints[name]) is dict else "B1,B2")
            option = typer.Option(None, flag, help=doc, metavar=metavar, show_default=False)
            annotation = str | None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option))

    def train(config: Path | None, list_options: bool, **values: Any) -> None:
        from trustscope.logger import LogDirError
        from trustscope.train.config import ConfigError, load_config
        from trustscope.train.loop import print_options, train_with_progress

        if list_options:
            print_options()
            return
        try:
            cfg = load_config(config, {k: v for k, v in values.items() if v is not None})
            train_with_progress(cfg)
        except (ConfigError, FileNotFoundError, FileExistsError, LogDirError) as exc:
            typer.echo(f"trustscope train: {exc}", err=True)
            raise typer.Exit(2) from exc

    train.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    train.__doc__ = TRAIN_HELP
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    single.command(name="train")(train)
    return typer.main.get_command(single)


class Commands(typer.core.TyperGroup):
    """The command group, with ``train`` built only when it runs (see :func:`train_command`): listing the
    commands shows its one-line help and imports nothing."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        at = names.index("report") if "report" in names else len(names)
        names = [*names[:at], "sql", *names[at:]]  # sql: a click command of its own (trustscope.sql_command)
        return [*names[:2], "train", *names[2:]]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "train":
            return click.Command("train", help=TRAIN_HELP, short_help=TRAIN_HELP.split("\n")[0])
        if name == "sql":
            return sql_command
        return super().get_command(ctx, name)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        return name, train_command() if name == "train" else command, rest


app = typer.Typer(
    cls=Commands,
    name="trustscope",
    help="Training-dynamics diagnostics for LLM reinforcement learning, with an integrated DPPO trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _rule_params(command: str, rules: list[str] | None) -> dict | None:
    """``--rule`` options as ``connect(rule_params=...)`` (None when there are none); bad input exits 2 with the
    parser's message (the rule, the parameter, the value and its bounds)."""
    if not rules:
        return None
    try:
        return rule_params_of(rules)
    except ValueError as exc:
        typer.echo(f"trustscope {command}: --rule: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def version() -> None:
    """Print the trustscope version."""
    typer.echo(__version__)


@app.command()
def dashboard(
    logdir: str | None = typer.Argument(None, help="Log directory or s3://bucket/prefix (default: the sample "
                                                  "logs)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the dashboard to the network."),
    port: int = typer.Option(8501, help="Port to serve on."),
    token: str | None = typer.Option(None, help="Access token every page asks for, on any address (default: "
                                     "$TRUSTSCOPE_DASHBOARD_TOKEN; on an address other than loopback, one is "
                                     "generated and printed with the URL when started from a terminal)."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Serve with no sign-in, even on an address other than "
                                 "loopback (anyone who can reach the port reads every run)."),
    rule: list[str] | None = typer.Option(None, "--rule", help=RULE_OPTION_HELP),
) -> None:
    """Serve the Streamlit dashboard over a log directory (localhost only unless --host says otherwise; any other
    address asks for an access token or an OIDC sign-in)."""
    import os

    from trustscope._dashboard import load

    if rule:
        _rule_params("dashboard", rule)
        os.environ[SETTINGS_ENV] = "\n".join(rule)
    try:
        load("app.launch").launch(logdir, host=host, port=port, token=token, no_auth=no_auth)
    except (OSError, ValueError) as exc:
        typer.echo(f"trustscope dashboard: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def demo(
    logdir: Path = typer.Option(Path("runs/demo"), help="Where the demo run is written (the shipped runs are "
                                "linked beside it)."),
    steps: int = typer.Option(24, help="Training steps of the demo run (the learning rate decays to 0 at the last)."),
    seed: int = typer.Option(0, help="Seed of the demo run (sampling, problems, mini-batch order)."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Serve the dashboard over the run afterwards."),
    port: int = typer.Option(8501, help="Dashboard port."),
    samples: bool = typer.Option(True, "--samples/--no-samples", help="Link the shipped sample runs into the log "
                                 "directory, to compare the demo run with."),
) -> None:
    """Train a short DPPO run whose reward climbs in the warm toy world (toy-v2-warm) while the trust region blocks
    tokens (bf16 rollouts, policy lag, eight mini-batches), print what to look at first and how it compares with the
    shipped PG-IS run, and serve the dashboard over it beside the shipped runs."""
    from trustscope.demo import run_demo
    from trustscope.train.config import ConfigError

    try:
        run_demo(logdir, steps=steps, serve=serve, port=port, samples=samples, seed=seed)
    except (OSError, ConfigError) as exc:
        typer.echo(f"trustscope demo: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def parity(
    model: str = typer.Option(..., "--model", help="A Hugging Face causal LM directory (save_pretrained layout), or "
                              "a toy preset name (toy, toy-v2, toy-moe), built or taken from the cache."),
    prompts: str = typer.Option("add1", "--prompts", help="A file of prompts (one a line, or a .json list of "
                                "strings) or a toy task's name (its eval split)."),
    engine: str = typer.Option("vllm", help="Rollout engine: vllm, or hf (transformers generate)."),
    engine_dtype: str = typer.Option("float32", help="The engine's dtype: float32 or bfloat16."),
    trainer_dtype: str = typer.Option("float32", help="The trainer forward's dtype: float32 or bfloat16."),
    n: int = typer.Option(1, help="Responses per prompt."),
    max_tokens: int = typer.Option(16, help="Response tokens at most."),
    max_prompts: int = typer.Option(32, help="Use the first this many prompts."),
    seed: int = typer.Option(0, help="Sampling seed."),
    full_positions: int = typer.Option(256, help="Generated positions (spread over the responses, the first token "
                                       "always) where the engine's and the trainer's whole distributions are "
                                       "compared (TV and KL over the vocabulary); 0: not."),
    attn_implementation: str | None = typer.Option(None, help="The trainer forward's attention implementation "
                                                   "(transformers' attn_implementation: eager, sdpa, "
                                                   "flash_attention_2, ...), as the run trains with it."),
    max_model_len: int | None = typer.Option(None, help="The vLLM engine's context (default: the longest prompt "
                                             "plus --max-tokens, within the model's max_position_embeddings)."),
    band: list[str] = typer.Option([], "--band", help="TOL=SHARE: at least SHARE of the tokens have |log pi - log "
                                   "mu| <= TOL (e.g. 1e-2=0.99); first:TOL=SHARE counts the first generated token "
                                   "only. Repeatable; a broken band exits 1."),
    logdir: Path | None = typer.Option(None, help="Log the tokens as a trustscope run here (mu = engine, pi = "
                                       "trainer), for the dashboard, report and doctor."),
    run_id: str | None = typer.Option(None, help="Run id of the logged run (default: a timestamp)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
) -> None:
    """Generate with the rollout engine, score the same tokens with the trainer's forward, and report the log-prob
    differences: shares within 1e-3 / 1e-2 / 0.1, by position, the first token apart, the largest with their text,
    the whole distributions' TV and KL at up to --full-positions positions and, on a mixture-of-experts model, by
    routing agreement. Exit 1 when a --band is broken, 2 on bad input."""
    import json

    from trustscope.parity import (
        ParityInputError,
        format_summary,
        log_parity,
        parse_band,
        read_prompts,
        run_parity,
    )
    from trustscope.parity import summary as parity_summary

    try:
        bands = [parse_band(b) for b in band]
        for name, value in (("--n", n), ("--max-tokens", max_tokens), ("--max-prompts", max_prompts)):
            if value < 1:
                raise ParityInputError(f"{name} must be >= 1, got {value}")
        if engine not in ("vllm", "hf"):
            raise ParityInputError(f"--engine must be vllm or hf, got {engine!r}")
        texts = read_prompts(prompts)[:max_prompts]
        model_dir = model
        if not Path(model).exists():
            from trustscope.train.worlds import get_world, worlds

            world = get_world(model)
            if world is None:
                raise ParityInputError(f"--model {model}: no such directory, nor a toy preset ({sorted(worlds())})")
            model_dir = str(world.build())  # cached, or copied from a build shipped with trustscope
        result = run_parity(model_dir, texts, engine=engine, engine_dtype=engine_dtype, trainer_dtype=trainer_dtype,
                            n=n, max_tokens=max_tokens, seed=seed, full_positions=full_positions,
                            attn_implementation=attn_implementation, max_model_len=max_model_len)
    except ParityInputError as exc:
        typer.echo(f"trustscope parity: {exc}", err=True)
        raise typer.Exit(2) from exc
    report = parity_summary(result)
    broken = result.broken(bands)
    typer.echo(format_summary(report, bands, broken))
    if logdir is not None:
        typer.echo(f"logged as run {log_parity(result, logdir, run_id)} in {logdir}")
    if json_out is not None:
        report["bands"] = [{"band": str(b), "share": result.within(b.tol, b.first),
                            "broken": any(b == bb for bb, _ in broken)} for b in bands]
        json_out.write_text(json.dumps(report, indent=2))
    if broken:
        typer.echo("trustscope parity: broken band(s): " + ", ".join(f"{b} (found {s:.2%})" for b, s in broken),
                   err=True)
        raise typer.Exit(1)


@app.command()
def validate(logdir: str = typer.Argument(..., help="A log directory, one run directory inside it, or an "
                                          "s3://bucket/prefix (endpoint and credentials from the AWS variables)."),
             repair: bool = typer.Option(False, "--repair", help="First finish or remove what killed writers and "
                                         "compactions left (local log directories): files no manifest lists that "
                                         "are provably superseded or orphaned, staged and superseded folders; "
                                         "each removal is printed. Ranks a live logger writes are skipped.")
             ) -> None:
    """Check a log directory against the schema; print each problem with its file, and each file that tools
    reading the folders (DuckDB, pyarrow, pandas, polars, Spark) read but no manifest lists. Exit 0 only when
    clean."""
    import tempfile

    from trustscope import runformat
    from trustscope.runformat.layout import SCHEMA_VERSION
    from trustscope.runformat.validation import run_dirs, validate_logdir

    if repair:
        from trustscope.runformat.maintenance import repair_run

        if runformat.is_remote(logdir):
            typer.echo("trustscope validate: --repair works on local log directories; on s3:// run "
                       "`trustscope compact`, which finishes and cleans what it can", err=True)
            raise typer.Exit(2)
        if not Path(logdir).is_dir():
            typer.echo(f"trustscope validate: {logdir} is not a directory", err=True)
            raise typer.Exit(2)
        for run in run_dirs(Path(logdir)):
            for line in repair_run(run):
                typer.echo(f"repair: {run}: {line}")
    with tempfile.TemporaryDirectory(prefix="trustscope-validate-") as scratch:
        local = Path(logdir)
        if runformat.is_remote(logdir):  # the committed objects and their manifests, copied whole
            try:
                local = runformat.mirror(logdir, Path(scratch))
            except (runformat.StorageError, ValueError) as exc:
                typer.echo(f"trustscope validate: {exc}", err=True)
                raise typer.Exit(2) from exc
        if not local.is_dir():
            typer.echo(f"trustscope validate: {logdir} is not a directory", err=True)
            raise typer.Exit(2)
        problems: list = validate_logdir(local)
        for problem in problems:
            inside = problem.path.relative_to(local).as_posix() if local != Path(logdir) else None
            where = problem.path if inside is None else logdir if inside == "." else f"{logdir}/{inside}"
            typer.echo(f"{where}: {problem.message}")
        if runformat.is_remote(logdir):  # what a plain reader of the prefix reads and no manifest commits
            try:
                strays = runformat.stray_objects(logdir)
            except runformat.StorageError as exc:
                typer.echo(f"trustscope validate: {exc}", err=True)
                raise typer.Exit(2) from exc
            for url in strays:
                typer.echo(f"{url}: read by tools that list the prefix but by no manifest; `trustscope compact` "
                           f"removes it when it is provably superseded or orphaned")
            problems += strays
        runs = run_dirs(local)
    if problems:
        typer.echo(f"trustscope validate: {len(problems)} problem(s) in {logdir}", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {len(runs)} run(s) in {logdir} match schema version {SCHEMA_VERSION}")


@app.command()
def compact(
    logdir: str = typer.Argument(..., help="A log directory, one run directory inside it, or an "
                                 "s3://bucket/prefix (endpoint and credentials from the AWS variables)."),
    grace: float = typer.Option(5.0, help="Seconds the rank folders a swap replaced are kept (under the run's "
                                "_superseded/), for readers that hold them open."),
    force: bool = typer.Option(False, "--force", help="s3:// only: also compact ranks whose manifest reads "
                               "running (object stores have no locks; only when no logger writes them)."),
) -> None:
    """Rewrite each rank's many small committed files as a few large ones (every reader sees the same rows,
    switched over by one atomic swap of the rank's folder), so reading costs follow rows, not files; what killed
    writers and compactions left is finished or removed first. A rank a live logger writes is skipped: the logger
    compacts its own files (TokenLogger(compact_every=...)). On s3:// and file systems that cannot swap folders,
    a tool listing the files in the moment between a compacted file's landing and the deletion of the files it
    replaces counts their rows twice (docs/logging.md)."""
    from trustscope.runformat.errors import CompactionError
    from trustscope.runformat.maintenance import compact_logdir
    from trustscope.runformat.retry import StorageError

    try:
        results = compact_logdir(logdir, grace_s=grace, force=force,
                                 echo=lambda line: typer.echo(f"trustscope compact: {line}", err=True))
    except (CompactionError, StorageError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"trustscope compact: {exc}", err=True)
        raise typer.Exit(1) from exc
    for r in results:
        ranges = ", ".join(f"{lo}-{hi}" for lo, hi in r.merged) or "nothing to merge"
        typer.echo(f"{r.run_dir} rank {r.rank}: {r.files_before} -> {r.files_after} files (flushes {ranges}), "
                   f"{r.deleted} deleted, {r.seconds:.1f} s")
        for warning in r.warnings:
            typer.echo(f"trustscope compact: {warning}", err=True)


@app.command()
def report(
    logdir: str | None = typer.Argument(None, help="A log directory, one run directory inside it, or an "
                                        "s3://bucket/prefix (default: the sample logs)."),
    html: Path | None = typer.Option(None, "--html", help="Also write an HTML page of charts."),
    output_format: str = typer.Option("text", "--format", help="text: tables fitted to the terminal's width; "
                                      "json: every figure of the report as one JSON object, for scripts."),
    inline_js: bool = typer.Option(False, "--inline-js", help="Put plotly.js inside the HTML page (one "
                                   "self-contained file, ~5 MB more) instead of plotly.min.js beside it."),
    warn_bad_rate: float = typer.Option(0.01, help="Collapse warning (beside the fitted detector, on "
                                        "runs logged with its signals): bad negative-update rate over the last "
                                        "--warn-window steps that fires it."),
    warn_mismatch_growth: float = typer.Option(2.0, help="Collapse warning: growth of mean |pi - mu| over the "
                                               "run's first window that fires it."),
    warn_window: int = typer.Option(10, help="Collapse warning: steps averaged."),
    warn_relative: float | None = typer.Option(None, "--warn-relative", help="Collapse warning against the run's "
                                               "own first --warn-window steps instead: the bad-update rate or mean "
                                               "|pi - mu| this many robust deviations (median, MAD) above them "
                                               "(replaces the two lines above, and the fitted detector by the one fitted in the run's own terms)."),
    ray: str | None = typer.Option(None, "--ray", help="Aggregate new files as Ray tasks on this cluster: auto, "
                                   "HOST:PORT or ray://HOST:PORT (trustscope installed on its nodes, the logs on "
                                   "storage they share)."),
    ray_fallback: str = typer.Option("warn", "--ray-fallback", help="When the --ray cluster cannot be reached: "
                                     "warn (and aggregate here) or error."),
    rule: list[str] | None = typer.Option(None, "--rule", help=RULE_OPTION_HELP),
    budget: float | None = typer.Option(None, "--budget", help="Equal-budget section: the share of the tokens "
                                        "with A != 0 every rule is moved to block, in (0, 1) (default: the share "
                                        "the run's own rule blocks)."),
) -> None:
    """Summarise every run of a log directory: reward, mismatch, what each rule would block, clipped tokens,
    collapse early warnings. A run with an unreadable file is flagged and left out; the others are reported."""
    import warnings

    import duckdb

    from trustscope.db import NoRunsFound, connect_readable
    from trustscope.distributed import RayUnavailable, RayUnavailableWarning
    from trustscope.early_warning import WarningLines
    from trustscope.report import print_json, print_report
    from trustscope.report_html import write_html
    from trustscope.runformat.retry import StorageError

    if logdir is None:
        from trustscope.paths import sample_logdir

        logdir = str(sample_logdir())
    if output_format not in ("text", "json"):
        typer.echo(f"trustscope report: --format {output_format!r}: use text or json", err=True)
        raise typer.Exit(2)
    rule_params = _rule_params("report", rule)
    if budget is not None:
        try:
            check_budget(budget)
        except ValueError as exc:
            typer.echo(f"trustscope report: --budget: {exc}", err=True)
            raise typer.Exit(2) from exc
    try:
        lines = WarningLines(warn_bad_rate, warn_mismatch_growth, warn_window, warn_relative)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RayUnavailableWarning)
            db, broken = connect_readable(logdir, ray=ray, ray_fallback=ray_fallback, rule_params=rule_params)
        for warning in caught:
            typer.echo(f"trustscope report: {warning.message}", err=True)
        with db:
            if output_format == "json":
                print_json(db, broken=broken, lines=lines, budget=budget)
            else:
                print_report(db, broken=broken, lines=lines, budget=budget)
            if html is not None:
                typer.echo(f"wrote {write_html(db, html, inline_js=inline_js, broken=broken, lines=lines)}")
    except (FileNotFoundError, NoRunsFound, StorageError, ValueError, RayUnavailable) as exc:
        typer.echo(f"trustscope report: {first_line(exc)}", err=True)
        raise typer.Exit(2 if isinstance(exc, FileNotFoundError | StorageError | RayUnavailable) else 1) from exc
    except (duckdb.Error, OSError) as exc:
        typer.echo(f"trustscope report: could not read {logdir}: {first_line(exc)}; run `trustscope validate "
                   f"{logdir}` to list broken files", err=True)
        raise typer.Exit(1) from exc


class ImportCommand(typer.core.TyperCommand):
    """``trustscope import``, whose help lists the registered formats (:data:`trustscope.importers.IMPORTERS`)
    and, for each format-specific option, the formats that declare it. The registry is read when this help is
    shown, not when the CLI starts: importing the importers takes longer than the rest of the CLI's start."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from trustscope.importers import IMPORTERS

        for param in self.params:
            takers = [f for f in IMPORTERS.values() if param.name in f.options]
            if param.name == "format":
                param.help = "; ".join(f"{f.name}: {f.reads}" for f in IMPORTERS.values()) + "."
            elif takers:
                param.help = f"{', '.join(f.name for f in takers)}: {takers[0].options[param.name]}."
        super().format_help(ctx, formatter)


@app.command("import", cls=ImportCommand)
def import_(
    format: str = typer.Argument(..., help="A registered format; `trustscope import --help` lists them."),
    src: Path = typer.Argument(..., help="The framework's files: the file or directory FORMAT reads."),
    logdir: Path = typer.Argument(..., help="Log directory the run is written into."),
    run_id: str | None = typer.Option(None, help="Run id (default: <framework>-<name of SRC>)."),
    source_version: str | None = typer.Option(None, help="The framework's version, recorded in run.json (the files "
                                                         "record none)."),
    allow_pickle: bool = typer.Option(False, help="Unpickle .pt files that hold more than tensors and plain values "
                                                  "(only for files you trust), for the formats that read .pt."),
    tokenizer: Path | None = typer.Option(None, help="The run's Hugging Face tokenizer directory (local), so "
                                                     "statistics name tokens."),
    follow: bool = typer.Option(False, "--follow", help="Follow a running job: append each step to the run once "
                                                        "its writer has finished it (prime-rl: STABLE; NeMo-RL: "
                                                        "a closed, settled file; slime/miles: both .pt sides, "
                                                        "settled), until --stop-after-idle or Ctrl-C. Stopped "
                                                        "and started again, it resumes after the last committed "
                                                        "step."),
    poll: float = typer.Option(2.0, min=0.0, help="--follow: seconds between two looks at SRC."),
    settle: float = typer.Option(2.0, min=0.0, help="--follow: seconds a step's files must stay unchanged "
                                                    "(after prime-rl's STABLE: for its metrics.jsonl row) before "
                                                    "the step is taken as finished."),
    stop_after_idle: float | None = typer.Option(None, min=0.0, help="--follow: stop once no new step has been "
                                                                     "finished for this many seconds (default: "
                                                                     "follow until Ctrl-C)."),
    token_fraction: float = typer.Option(1.0, min=0.0, max=1.0,
                                         help="Write the token rows of only this share of sequences (the logger's "
                                              "hash of step and sample id), with the exact summaries table over "
                                              "every token, as TokenLogger(token_fraction=...) does."),
    workers: int | None = typer.Option(None, min=1, help="Processes that parse the steps while this one writes "
                                                         "(formats read step by step: prime-rl, nemo-rl; default: "
                                                         "the idle cores, at most 4; 1: none)."),
) -> None:
    """Import another framework's per-token dump as a trustscope run; all or nothing (bad input names the file).
    With --follow, a running job's dump is followed step by step. Fields the dump has and trustscope does not
    know are kept as the run's own columns where a column takes them, and named once on stderr."""
    import warnings

    from trustscope.importers import ImportFormatError, ImportUsageError

    def named(message: Any, *args: Any, **kwargs: Any) -> None:
        typer.echo(f"trustscope import: {message}", err=True)

    try:
        with warnings.catch_warnings():  # the unknown fields' ImportWarning, shown once (Python hides them)
            warnings.simplefilter("always", ImportWarning)
            warnings.showwarning = named
            run_dir, result = _import(follow, format, src, logdir, run_id, source_version, tokenizer, poll, settle,
                                      stop_after_idle, allow_pickle, token_fraction, workers)
    except ImportUsageError as exc:  # an unknown format, or an option the format does not take
        typer.echo(f"trustscope import: {exc}", err=True)
        raise typer.Exit(2) from exc
    except (ImportFormatError, OSError, ValueError) as exc:  # OSError: the run exists, the disk is full, ...
        typer.echo(f"trustscope import: {exc}", err=True)
        raise typer.Exit(1) from exc
    if follow:
        last = "no step" if result.last_step is None else f"steps through {result.last_step}"
        typer.echo(f"followed {src} as {result.run_dir}: {len(result.imported)} step(s) imported this time, {last} "
                   f"in the run ({'idle' if result.stopped == 'idle' else 'stopped'})")
        if result.waiting:
            typer.echo(f"not finished by the writer yet: step(s) {', '.join(map(str, result.waiting))} (the next "
                       f"start takes them once they are)")
    else:
        typer.echo(f"imported {src} as {run_dir}")


def _import(follow: bool, format: str, src: Path, logdir: Path, run_id: str | None, source_version: str | None,
            tokenizer: Path | None, poll: float, settle: float, stop_after_idle: float | None, allow_pickle: bool,
            token_fraction: float, workers: int | None) -> tuple[Path | None, Any]:
    """``trustscope import``'s work: ``(run directory, None)`` of an import, ``(None, FollowResult)`` of a follow."""
    from trustscope.importers import ImportUsageError, follow_run, import_run

    if follow:
        def said(step: int, sequences: int, rows: int) -> None:
            typer.echo(f"step {step}: {sequences} sequences, {rows} token rows")

        if workers is not None:
            raise ImportUsageError("--workers is an option of a one-shot import (--follow reads one step at a time)")
        typer.echo(f"following {src} ({format}) into {logdir}; Ctrl-C stops after the step being imported",
                   err=True)
        return None, follow_run(format, src, logdir, run_id=run_id, version=source_version, tokenizer=tokenizer,
                                poll_s=poll, settle_s=settle, stop_after_idle_s=stop_after_idle, on_step=said,
                                allow_pickle=allow_pickle, token_fraction=token_fraction)
    for name, value in (("--poll", poll != 2.0), ("--settle", settle != 2.0),
                        ("--stop-after-idle", stop_after_idle is not None)):
        if value:
            raise ImportUsageError(f"{name} is an option of --follow")
    return import_run(format, src, logdir, run_id=run_id, version=source_version, tokenizer=tokenizer,
                      allow_pickle=allow_pickle, token_fraction=token_fraction, workers=workers), None


class DoctorCommand(typer.core.TyperCommand):
    """``trustscope doctor``, whose help ends with the list of checks (:data:`trustscope.doctor.CHECKS`), read when
    the help is shown: importing the doctor takes longer than the rest of the CLI's start."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from trustscope.doctor import CHECKS

        self.epilog = "Checks: " + "; ".join(f"{c.name} ({c.about})" for c in CHECKS.values()) + "."
        super().format_help(ctx, formatter)


@app.command(cls=DoctorCommand)
def doctor(
    logdir: Path = typer.Argument(..., help="A log directory, or one run directory inside it."),
    run: list[str] | None = typer.Option(None, "--run", help="Check only this run (repeatable)."),
    from_step: int | None = typer.Option(None, "--from-step", help="Read only the steps from this one on."),
    webhook: str | None = typer.Option(None, "--webhook", help="Post each failed check to this Slack-compatible "
                                       "webhook URL (docs/trackers.md)."),
    rule: list[str] | None = typer.Option(None, "--rule", help=RULE_OPTION_HELP),
) -> None:
    """Contract checks on any log, native or imported: each measures one way the logged numbers can be wrong and
    gives a verdict (the list ends this help). Exit 1 when a check fails, 2 when a run cannot be read whole (it is
    left out, and said so; the others are checked)."""
    import duckdb

    from trustscope.db import NoRunsFound, connect_readable
    from trustscope.doctor import VERDICTS, diagnose, failed, format_finding

    if not logdir.is_dir():
        typer.echo(f"trustscope doctor: {logdir} is not a directory", err=True)
        raise typer.Exit(2)
    try:
        if webhook is not None:  # the alerts' HTTP client is imported only when asked for
            from trustscope.alerts import Alerts, check_webhook_url

            webhook = check_webhook_url(webhook)
    except ValueError as exc:
        typer.echo(f"trustscope doctor: --webhook: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        db, broken = connect_readable(logdir, cache=False, rule_params=_rule_params("doctor", rule))
        with db:
            findings = diagnose(db, run or None, first_step=from_step)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"trustscope doctor: {exc.args[0] if isinstance(exc, KeyError) else exc}", err=True)
        raise typer.Exit(2) from exc
    except NoRunsFound as exc:  # no run, or none readable (the message says which, and names validate)
        typer.echo(f"trustscope doctor: cannot read {exc}", err=True)
        raise typer.Exit(2) from exc
    except duckdb.Error as exc:  # a file damaged after the check: validate names it
        typer.echo(f"trustscope doctor: cannot read {logdir}: {str(exc).splitlines()[0]}; `trustscope validate "
                   f"{logdir}` names every broken file", err=True)
        raise typer.Exit(2) from exc
    left_out("doctor", broken)
    if not findings:
        typer.echo(f"trustscope doctor: no runs in {logdir}", err=True)
        raise typer.Exit(2)
    for run_id, run_findings in findings.items():
        typer.echo(f"run {run_id}")
        for finding in run_findings:
            typer.echo("\n".join(format_finding(finding)))
    n_failed = failed(findings)
    verdicts = [f.verdict for fs in findings.values() for f in fs]
    typer.echo(f"{len(findings)} run(s): " + ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS))
    if webhook is not None and n_failed:
        alerts = Alerts(webhook, min_interval_s=0)
        alerts.doctor(findings)
        alerts.close(timeout_s=60)  # sends what is queued (a post that fails is retried at once when closing)
        report = alerts.report
        typer.echo(f"webhook: {report['sent']} alert(s) sent" + (f", {report['failed']} failed: {report['errors'][0]}"
                                                                 if report["failed"] else ""), err=True)
    if broken:
        raise typer.Exit(2)
    if n_failed:
        raise typer.Exit(1)


@app.command()
def explain(
    logdir: Path = typer.Argument(..., help="A log directory, or one run directory inside it."),
    run: list[str] | None = typer.Option(None, "--run", help="Explain only this run (repeatable)."),
    output: str = typer.Option("text", "--format", help="text, or json (every run's causes, each with its source, "
                               "share, interval and tokens; every rule's blocked tokens the same)."),
    window: int | None = typer.Option(None, "--window", help="Steps per window (default: each run's steps in 4 "
                                      "windows)."),
    from_step: int | None = typer.Option(None, "--from-step", help="Read only the steps from this one on."),
    replicates: int = typer.Option(200, "--replicates", help="Bootstrap replicates for the intervals (0: none)."),
    blocked: list[str] | None = typer.Option(None, "--blocked", help="Allocate this rule's blocked tokens in the "
                                             "text (repeatable; default: the run's own rule; JSON has every rule)."),
) -> None:
    """Where a run's mismatch comes from: mean |log pi - log mu| (and KL k3) per run and per window of steps, and each
    rule's blocked tokens, allocated to the known causes (temperature, top-k/top-p truncation, position shift, token
    drift, staleness, MoE routing) plus an unexplained remainder, by Shapley values over the causes' token
    indicators, with shares adding up to 1, token counts and bootstrap intervals (docs/explain.md). A cause whose
    columns the run lacks is "not measurable: needs `COLUMN`". Exit 2 when a run cannot be read whole."""
    import duckdb

    from trustscope.db import NoRunsFound, connect_readable
    from trustscope.explain import render
    from trustscope.explain.analysis import explain as explain_runs

    if output not in ("text", "json"):
        typer.echo(f"trustscope explain: --format {output!r} must be text or json", err=True)
        raise typer.Exit(2)
    if not logdir.is_dir():
        typer.echo(f"trustscope explain: {logdir} is not a directory", err=True)
        raise typer.Exit(2)
    try:
        db, broken = connect_readable(logdir, cache=False)
        with db:
            found = explain_runs(db, run or None, window=window, first_step=from_step, replicates=replicates)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"trustscope explain: {exc.args[0] if isinstance(exc, KeyError) else exc}", err=True)
        raise typer.Exit(2) from exc
    except NoRunsFound as exc:
        typer.echo(f"trustscope explain: cannot read {exc}", err=True)
        raise typer.Exit(2) from exc
    except duckdb.Error as exc:
        typer.echo(f"trustscope explain: cannot read {logdir}: {str(exc).splitlines()[0]}; `trustscope validate "
                   f"{logdir}` names every broken file", err=True)
        raise typer.Exit(2) from exc
    left_out("explain", broken)
    if not found.runs:
        typer.echo(f"trustscope explain: no token rows in {logdir}", err=True)
        raise typer.Exit(2)
    typer.echo(render.to_json(found) if output == "json" else render.text(found, blocked))
    if broken:
        raise typer.Exit(2)


if __name__ == "__main__":  # python -m trustscope.cli; the console script is trustscope.entry
    app()
