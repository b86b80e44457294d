"""Which runs a log directory holds, which of their committed files a reader can read, and why not.

:func:`run_problems` is the one check of a broken run, behind :attr:`LogDB.broken_runs`, the dashboard and the CLI:
a ``run.json`` that is not a JSON object, committed data files (and the vocabulary) whose Parquet footer does not
read. Footers are read once per path, size and modification time.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import runformat


def run_dirs(paths: Sequence[Path]) -> list[Path]:
    """The runs under ``paths``; a run directory that is a symlink is followed (its target is read)."""
    runs: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"log directory {str(path)!r} does not exist or is not a directory")
        runs += runformat.run_dirs(path)
    return sorted(set(runs))


def readable_dirs(paths: Sequence[Path], runs: Sequence[Path]) -> list[Path]:
    """The resolved directories the views may read: the log directories and the targets of symlinked runs."""
    resolved = {p.resolve() for p in paths}
    for run in runs:
        target = run.resolve()
        if not any(target.is_relative_to(p) for p in resolved):
            resolved.add(target)
    return sorted(resolved)


def in_words(problems: list[str], shown: int = 3) -> str:
    """A run's problems as one line: the first ``shown``, then how many more."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f" (+{more} more)" if more > 0 else "")


def manifest_problem(path: Path) -> str | None:
    """Why a run's ``run.json`` cannot be read as a JSON object, or None when it can."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"unreadable {runformat.MANIFEST} ({err})"
    return None if isinstance(manifest, dict) else f"{runformat.MANIFEST} is not a JSON object"


def data_files(run: Path, table: str) -> list[Path]:
    return runformat.committed_files(run)[table]


@functools.lru_cache(maxsize=4096)
def _read_footer(path: str, size: int, mtime_ns: int) -> pq.FileMetaData | str:
    try:
        return pq.read_metadata(path)
    except (OSError, pa.ArrowException) as exc:
        return f"{Path(path).name}: not a readable Parquet file ({str(exc).splitlines()[0][:200]})"


def footer(path: Path | str) -> pq.FileMetaData | str:
    """The Parquet footer of a data file, or why it cannot be read. Read once per path, size and modification
    time (a committed file does not change; one that does is read again), so every check of the same file
    (readability at each cursor, the stored bits, the batch sizes of the first pass) costs one read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{Path(path).name}: cannot be read ({exc.strerror or exc})"
    return _read_footer(str(path), st.st_size, st.st_mtime_ns)

PARQUET_MAGIC = b"PAR1"


@functools.lru_cache(maxsize=1 << 16)
def _frame_problem(path: str, size: int, mtime_ns: int) -> str | None:
    name = Path(path).name
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 8, 0))
            tail = f.read(8)
    except OSError as exc:
        return f"{name}: cannot be read ({exc.strerror or exc})"
    if size < 12 or head != PARQUET_MAGIC or tail[4:] != PARQUET_MAGIC:
        return f"{name}: not a readable Parquet file (no Parquet marker at its {'start' if head != PARQUET_MAGIC else 'end'}: cut short, or not Parquet)"
    if int.from_bytes(tail[:4], "little") + 12 > size:
        return f"{name}: not a readable Parquet file (its footer would start before the file does: cut short)"
    return None


def unreadable_files(files: Iterable[Path]) -> dict[Path, str]:
    """The ``files`` that are not whole Parquet files (cut short, not Parquet, gone), with why: each file's frame
    (the marker at both ends, the footer's length) read once per path, size and modification time, a few bytes
    each, so checking a run costs little per file however many it has. The footer itself is read only where a
    reader needs it (:func:`footer`)."""
    out = {}
    for f in files:
        try:
            st = os.stat(f)
        except OSError as exc:
            out[f] = f"{Path(f).name}: cannot be read ({exc.strerror or exc})"
            continue
        if (problem := _frame_problem(str(f), st.st_size, st.st_mtime_ns)) is not None:
            out[f] = problem
    return out


def run_problems(run_dir: Path, files: Mapping[str, Sequence[Path]] | None = None) -> list[str]:
    """What a reader cannot read of a run: a ``run.json`` that is not a JSON object, committed data files
    (``files``: :func:`trustscope.runformat.commits.committed_files`, listed when None) and a vocabulary whose Parquet footer
    does not read. The one check behind :attr:`LogDB.broken_runs`, the dashboard's and the CLI's."""
    return listed(*check_run(run_dir, runformat.committed_files(run_dir) if files is None else files))


def listed(manifest: str | None, unreadable: Mapping[Path, str]) -> list[str]:
    return [p for p in [manifest] if p] + list(unreadable.values())


def check_run(run_dir: Path, files: Mapping[str, Sequence[Path]]) -> tuple[str | None, dict[Path, str]]:
    """:func:`run_problems` as (the manifest's problem, the unreadable files with theirs)."""
    manifest = run_dir / runformat.MANIFEST
    vocab = [run_dir / runformat.VOCAB_FILE] if (run_dir / runformat.VOCAB_FILE).is_file() else []
    return (manifest_problem(manifest) if manifest.is_file() else missing_manifest(run_dir),
            unreadable_files([*vocab, *(f for table in files.values() for f in table)]))


def missing_manifest(run_dir: Path) -> str:
    """Why a run without ``run.json`` is not read: rank 0 never wrote it (only other ranks logged), so the run's
    settings (its rule, mu's source, the config) are unknown; every reader refuses it alike, naming the file."""
    ranks = sorted(p.stem.removeprefix("rank") for p in (run_dir / runformat.RANKS_DIR).glob("rank*.json"))
    logged = f"rank(s) {', '.join(str(int(r)) for r in ranks if r.isdigit())} logged" if ranks else "files exist"
    return (f"{runformat.MANIFEST} is missing: rank 0 never wrote the run's manifest ({logged}); the run's settings "
            f"are unknown, so it is not read")


def logged_fraction(manifest: dict[str, Any]) -> float | None:
    """The ``token_fraction`` a run's logger kept (run.json's ``logging``), None when the manifest does not say."""
    logging = manifest.get("logging")
    value = logging.get("token_fraction") if isinstance(logging, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
