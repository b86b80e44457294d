"""Importers: other RL frameworks' per-token dumps as trustscope runs (``trustscope import FORMAT SRC LOGDIR``).

One module per format, each with a ``read(src, *, version=None, ...)`` that parses and checks everything into an
:class:`~trustscope.importers.base.ImportedRun`; :func:`import_run` then writes it through ``TokenLogger`` with
``mu_source="imported"`` and the source framework in ``run.json``, all or nothing.

=============  ===============================================================  ===========================
format         what it reads                                                    module
=============  ===============================================================  ===========================
``prime-rl``   ``token_exports/step_<N>/rank_<R>.jsonl`` (trainer token export)  :mod:`.prime_rl`
``slime``      ``--dump-details`` dir: ``rollout_data/`` + ``train_data/`` .pt   :mod:`.slime`
``miles``      the same for miles (per-rank train files, CP slices joined)      :mod:`.slime`
``nemo-rl``    ``train_data_step<N>.jsonl`` (GRPO's per-step training data)      :mod:`.nemo_rl`
=============  ===============================================================  ===========================
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from trustscope.importers.base import ImportedRun, ImportFormatError, write_run

__all__ = ["FORMATS", "ImportFormatError", "import_run", "read_source"]

FORMATS: dict[str, tuple[str, str]] = {
    "prime-rl": ("trustscope.importers.prime_rl", "prime-rl"),
    "slime": ("trustscope.importers.slime", "slime"),
    "miles": ("trustscope.importers.slime", "miles"),
    "nemo-rl": ("trustscope.importers.nemo_rl", "nemo-rl"),
}
"""Format name -> (module with ``read``, framework name recorded in run.json)."""


def read_source(fmt: str, src: str | Path, *, version: str | None = None, **options: Any) -> ImportedRun:
    """Parse ``src`` as format ``fmt`` (a key of :data:`FORMATS`) without writing anything."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown import format {fmt!r}; known: {', '.join(FORMATS)}")
    module, framework = FORMATS[fmt]
    return importlib.import_module(module).read(Path(src), version=version, framework=framework, **options)


def import_run(fmt: str, src: str | Path, logdir: str | Path, *, run_id: str | None = None,
               version: str | None = None, tokenizer: str | Path | None = None, **options: Any) -> Path:
    """Import ``src`` (format ``fmt``) as one run under ``logdir``; returns the run directory.

    ``tokenizer``: a local Hugging Face tokenizer directory (the run's own), loaded without network access, whose
    token texts become the run's vocab table. Nothing is written unless every file parses and checks; the run
    appears by one rename at the end.
    """
    vocab = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            vocab = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"tokenizer {str(tokenizer)!r} cannot be loaded: {err}") from None
    return write_run(read_source(fmt, src, version=version, **options), logdir, run_id, vocab=vocab)
