"""Importers: other RL frameworks' per-token dumps as trustscope runs (``trustscope import FORMAT SRC LOGDIR``).

One module per framework. Each registers its importer, a function that parses and checks a whole source into an
:class:`~trustscope.importers.base.ImportedRun` (the :class:`~trustscope.importers.base.Importer` protocol), with
:func:`~trustscope.importers.base.register_importer`; :data:`IMPORTERS` lists them and ``trustscope import --help``
prints them. :func:`import_run` then writes the run through ``TokenLogger`` with ``mu_source="imported"`` and the
source framework in ``run.json``, all or nothing.

A new format: a module here with ``@register_importer("name", reads="...")`` on its ``read``, imported below.
The registry is the only list of formats: ``trustscope import`` and ``--follow`` (:mod:`trustscope.importers.follow`,
which follows the formats that declare ``finished=``) both read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trustscope.importers import nemo_rl, prime_rl, slime  # noqa: F401  (each registers its formats)
from trustscope.importers.base import (
    IMPORTERS,
    ImportedRun,
    ImportFormatError,
    ImportUsageError,
    checked_options,
    combine,
    format_for,
    name_unknown,
    register_importer,
)
from trustscope.importers.follow import follow as _follow  # (the package keeps .follow, the module)
from trustscope.importers.writer import read_steps, write_run, write_steps

__all__ = ["IMPORTERS", "ImportFormatError", "ImportUsageError", "checked_options", "follow_run", "format_for",
           "import_run", "load_vocab", "read_source", "register_importer"]


def read_source(fmt: str, src: str | Path, *, version: str | None = None, **options: Any) -> ImportedRun:
    """Parse ``src`` as format ``fmt`` without writing anything. ``options`` are the format's own (see
    :data:`IMPORTERS`): one the format does not take is refused when it is set (not ``None`` or ``False``)."""
    given = checked_options(fmt, options)
    run = format_for(fmt).read(Path(src), version=version, **given)
    name_unknown(run)
    return run


def load_vocab(tokenizer: str | Path | None) -> Any:
    """The tokenizer in the local directory ``tokenizer`` (loaded without network access), or None."""
    if tokenizer is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer {str(tokenizer)!r} cannot be loaded: {err}") from None


def import_run(fmt: str, src: str | Path, logdir: str | Path, *, run_id: str | None = None,
               version: str | None = None, tokenizer: str | Path | None = None, token_fraction: float = 1.0,
               workers: int | None = None, **options: Any) -> Path:
    """Import ``src`` (format ``fmt``) as one run under ``logdir``; returns the run directory.

    ``tokenizer``: a local Hugging Face tokenizer directory (the run's own), loaded without network access, whose
    token texts become the run's vocab table. Nothing is written unless every file parses and checks; the run
    appears by one rename at the end. ``token_fraction`` < 1: the token rows of that share of sequences, with the
    exact summaries over every token (:func:`~trustscope.importers.writer.write_steps`).

    A format that lists its steps (prime-rl, NeMo-RL) is read step by step on ``workers`` processes (default
    :func:`~trustscope.importers.writer.default_workers`; 1: in this process) while this one writes, a few steps in
    memory at a time (:func:`~trustscope.importers.writer.read_steps`); the others are read whole, then written.
    """
    vocab = load_vocab(tokenizer)
    importer = format_for(fmt)
    given = checked_options(fmt, options)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ImportUsageError(f"workers must be an int >= 1, got {workers!r}")
    if importer.steps is None:
        return write_run(importer.read(Path(src), version=version, **given), logdir, run_id, vocab=vocab,
                         token_fraction=token_fraction)
    parts = read_steps(fmt, Path(src), version=version, workers=workers, options=given)
    return write_steps(parts, logdir, run_id, vocab=vocab, token_fraction=token_fraction,
                       combine=importer.combine or combine)


def follow_run(fmt: str, src: str | Path, logdir: str | Path, *, run_id: str | None = None,
               version: str | None = None, tokenizer: str | Path | None = None, poll_s: float = 2.0,
               settle_s: float = 2.0, stop_after_idle_s: float | None = None, on_step: Any = None,
               should_stop: Any = None, token_fraction: float = 1.0, **options: Any) -> Any:
    """Follow a running job's ``src`` into one run under ``logdir``, step by step as its writer finishes them
    (:func:`trustscope.importers.follow.follow`, whose docstring says when a step is finished); returns its
    :class:`~trustscope.importers.follow.FollowResult`."""
    return _follow(fmt, src, logdir, run_id=run_id, version=version, vocab=load_vocab(tokenizer), poll_s=poll_s,
                  settle_s=settle_s, stop_after_idle_s=stop_after_idle_s, on_step=on_step, options=options,
                  should_stop=should_stop, token_fraction=token_fraction)

