"""Data files' footers: the metadata keys a flush and a compaction write, and reading footers and folder sizes from a store.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

import pyarrow.parquet as pq

from trustscope.runformat.layout import FLUSH_META_PREFIX
from trustscope.runformat.stores import RunStore

SOURCES_META = "trustscope.compacted.sources"
"""Footer key of a compacted file: JSON ``[[name, rows], ...]``, the files it replaced (flush files or earlier
compacted files of the same folder), in the order of its rows. Their kept aggregates, merged, are its own."""


ORIGINALS_META = "trustscope.compacted.originals"
"""Footer key of a compacted file: JSON ``[[name, flush, first_step, last_step, rows, tokens_generated,
tokens_logged, dropped_rows], ...]``, every flush file whose rows it holds, in row order (a flush's rows are
contiguous; the counts are the flush's, repeated in each of its files, None where a file had none)."""


OWN_META_PREFIXES = (FLUSH_META_PREFIX.encode(), b"trustscope.compacted.", b"ARROW:schema")


COUNTS = ("tokens_generated", "tokens_logged", "dropped_rows")


def file_sizes(store: RunStore, folder: Any) -> dict[str, int]:
    """name -> size of the files directly in ``folder`` (none when it does not exist)."""
    if store.remote:
        from pyarrow.fs import FileSelector, FileType

        infos = store.fs.get_file_info(FileSelector(str(folder), allow_not_found=True))
        return {PurePosixPath(i.path).name: i.size for i in infos if i.type == FileType.File}
    out = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                if entry.is_file():
                    out[entry.name] = entry.stat().st_size
    return out


@contextlib.contextmanager
def opened_file(store: RunStore, path: Any, meta: pq.FileMetaData | None = None) -> Iterator[pq.ParquetFile]:
    """``path`` opened for reading; with ``meta``, its footer is not read again."""
    if store.remote:
        with store.fs.open_input_file(str(path)) as f:
            yield pq.ParquetFile(f, metadata=meta)
    else:
        with pq.ParquetFile(path, metadata=meta) as f:
            yield f


def read_footer(store: RunStore, path: Any) -> pq.FileMetaData:
    """The Parquet footer of ``path`` on ``store`` (local or an object store)."""
    with opened_file(store, path) as f:
        return f.metadata


def flush_firsts(footers: list[pq.FileMetaData]) -> dict[int, tuple[int, list]]:
    """flush -> (its first step, its token counts) over the :data:`ORIGINALS_META` of one record's files' footers."""
    out: dict[int, tuple[int, list]] = {}
    for meta in footers:
        for entry in json.loads((meta.metadata or {}).get(ORIGINALS_META.encode(), b"[]")):
            flush, first, counts = entry[1], entry[2], entry[5:8]
            out[flush] = (min(first, out[flush][0]), out[flush][1]) if flush in out else (first, counts)
    return out
