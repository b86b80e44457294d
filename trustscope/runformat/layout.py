"""The on-disk layout of a run and its names: folders, file names, the Arrow schemas of the log tables and their
Parquet settings.

Layout of one run (``<logdir>/<run_id>/``, :data:`LAYOUT` 2)::

    run.json                      manifest: run id, SCHEMA_VERSION, LAYOUT, config, model, sampling, tokenizer, status
    vocab.parquet                 token_id -> text
    tokens/r<rank>/*.parquet      one row per logged response token, one folder per rank
    samples/r<rank>/*.parquet     one row per response
    steps/r<rank>/*.parquet       long-form scalars (name, value) per step
    summaries/r<rank>/*.parquet   exact per-step aggregates over every token (trustscope.logger.summaries)
    ranks/rank<r>.json            status of every rank other than 0 (rank 0's is in run.json)
    _staging/, _superseded/       a compaction's next rank folders, and the folders it replaced (never read)

Runs of layout 1 (older loggers, ``tests/data/legacy``) keep every rank's files directly in the table folder
(``tokens/*.parquet``); readers read both. Files are written under a temporary name (``.<name>.tmp``, which
``*.parquet`` does not match) in the table folder and renamed into the rank folder, so a reader never sees half a
file. Each rank writes its own files, named ``r<rank>-s<first step>-<last step>-f<flush>``: one flush of a rank
writes one file per table, all with the same flush number. The rank's manifest records that number as
``committed_flush`` first, and the files are renamed into place after (:mod:`trustscope.logger.writer`), so a file
that any reader can list is always one the manifest commits: trustscope's readers (:func:`committed_files`) and a
plain glob of the folders see the same files of each table at every moment.
Compaction (:mod:`trustscope.runformat.compaction`) rewrites consecutive committed flushes of a rank as one file per
table, ``r<rank>-s<first step>-<last step>-c<first flush>-<last flush>``, records it in the same manifest
(:data:`COMPACTED_KEY`), and swaps the rank's folder for one that holds the compacted file instead of the flush
files it replaces in one atomic rename (``renameat2(RENAME_EXCHANGE)``): every reader sees the one or the other,
never both, never neither.

Keys: ``sample_id`` is unique within ``(run_id, step)`` over all ranks; ``(run_id, step, sample_id, pos)`` is the
token key. ``pos`` is the position in the response (0 = first generated token).

Nullable columns (declared in :mod:`trustscope.columns`) may hold nulls; every other column must not. Every file
carries ``trustscope.schema_version`` and ``trustscope.table`` in its Arrow schema metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa

from trustscope import columns as C

SCHEMA_VERSION = 1
"""Version of the tables below; written into every run manifest and every file. Bump on any change."""


TABLES = ("tokens", "samples", "steps", "summaries")
"""Tables written as a directory of Parquet files per run (``vocab`` is one file)."""


LAYOUT = 2
"""Version of the run directory's layout, written into every rank manifest as ``layout``: 2, one folder per rank
inside each table folder (``tokens/r0000/``); 1 (or no ``layout`` key), every file directly in the table folder.
A resumed run keeps the layout it was created with."""


LAYOUT_KEY = "layout"


STAGING_DIR = "_staging"
"""Where a compaction builds a rank's next folders (``<run>/_staging/r<rank>-c<first>-<last>/<table>/``)."""


SUPERSEDED_DIR = "_superseded"
"""Where the folders a compaction replaced wait for deletion (``<run>/_superseded/<unix ms>-r<rank>-.../``)."""


RANK_DIR_RE = re.compile(r"^r(\d+)$")


MANIFEST = "run.json"


VOCAB_FILE = "vocab.parquet"


RANKS_DIR = "ranks"


TMP_PREFIX = "."


TMP_SUFFIX = ".tmp"


LOGPROB_TOLERANCE = 1e-5
"""Log-probabilities up to this much above 0 (float rounding of log 1) are accepted and clamped to 0."""


STATUSES = ("running", "finished", "crashed")


TOKENS = C.arrow_schema(C.TOKEN_COLUMNS)
"""One row per logged response token (declared in :data:`trustscope.columns.TOKEN_COLUMNS`)."""


BLOCKED_RULES_META = "trustscope.blocked_rules"
"""Footer key of a tokens file whose ``blocked_rules`` the logger computed: a JSON list of ``[rule, parameters]``,
bit i of ``blocked_rules`` standing for entry i (at most :data:`MAX_BLOCKED_RULES` entries)."""


MAX_BLOCKED_RULES = 63
"""Rules one ``blocked_rules`` value can hold (int64, the sign bit left unused)."""


SAMPLES = C.arrow_schema(C.SAMPLE_COLUMNS)
"""One row per response (every response of the step, also when only a fraction of its tokens is logged)."""


STEPS = C.arrow_schema(C.STEP_COLUMNS)
"""Long-form scalars: reward, loss, lr, timings, grad norm, ... (NaN and inf are kept: a NaN loss is news)."""


SUMMARIES = C.arrow_schema(C.SUMMARY_COLUMNS)
"""Exact per-step aggregates over every token handed to ``log_step`` (whatever ``token_fraction`` keeps), one row
per (step, metric, group) and flush, the step's calls merged by the writer; see :mod:`trustscope.logger.summaries`.
Mergeable: sum counts and sums, min/max the extremes over parts and ranks (the ``summaries`` view does)."""


TABLE_VERSIONS: dict[str, int] = C.table_versions()
"""Version of a table changed after :data:`SCHEMA_VERSION`'s set, in its files' metadata
(``trustscope.table_version``): the highest ``since`` of its columns. Files written before have an older version or
no such key (tokens version 2 added ``blocked_rules``, 3 ``policy_version``, ``turn`` and ``engine_token_id``;
summaries version 2 ``dimension`` and ``bucket``)."""


VOCAB = C.arrow_schema(C.VOCAB_COLUMNS)
"""Token id -> decoded text, so statistics can name tokens."""


SCHEMAS: dict[str, pa.Schema] = {"tokens": TOKENS, "samples": SAMPLES, "steps": STEPS, "summaries": SUMMARIES,
                                  "vocab": VOCAB}


LOGPROB_COLUMNS = ("mu_logprob", "old_logprob", "pi_logprob")


TOPK_LOGPROB_COLUMNS = ("mu_topk_logprobs", "pi_topk_logprobs")


TOPK_COLUMNS = ("mu_topk_ids", *TOPK_LOGPROB_COLUMNS)


@dataclass(frozen=True)
class WriteOptions:
    """Parquet settings of one table, chosen by measurement (see ``docs/performance.md``).

    Dictionary encoding only where it pays (run_id, loss_rule, names: a handful of distinct strings).
    BYTE_STREAM_SPLIT on every float column of ``tokens``, list values included (keyed by their leaf path
    ``<name>.list.element``): zstd then sees the exponent bytes apart from the noisy low mantissa bytes.
    Measured on rollout-like K = 20 rows: 190 -> 172 bytes/row at float32 top-K, and no slower. The top-K ids
    too: their high bytes are mostly zero, so zstd gets 26.6 -> 20.4 bytes/row out of them at about 60 % of the
    CPU (172 -> 166 bytes/row in all). That needs readers of Parquet format 2.11 (pyarrow 17+, DuckDB 1.1+,
    polars, parquet-java 1.14+); the other integer columns stay PLAIN (under 3 bytes/row together).
    ``statistics``: the columns that get min/max statistics (None: all). The top-K lists get none: no query
    prunes on them, and computing them is ~15 % of the encoding time of the tokens table.
    """

    dictionary: tuple[str, ...]
    byte_stream_split: tuple[str, ...]
    compression: str = "zstd"
    compression_level: int = 1
    statistics: tuple[str, ...] | None = None

    def writer_kwargs(self) -> dict:
        return {
            "compression": self.compression,
            "compression_level": self.compression_level,
            "use_dictionary": list(self.dictionary),
            "use_byte_stream_split": list(self.byte_stream_split),
            "write_statistics": True if self.statistics is None else list(self.statistics),
        }


def _leaf(name: str) -> str:
    """Parquet's path of the values of list column ``name`` (what per-column encodings are keyed by)."""
    return f"{name}.list.element"


def _write_options(table: str) -> WriteOptions:
    """A table's Parquet settings from its columns' declarations (:mod:`trustscope.columns`): dictionary encoding
    where declared, BYTE_STREAM_SPLIT on the float columns (and the top-K lists' values) of ``tokens``, statistics
    where declared (None: on every column)."""
    cols = C.TABLE_COLUMNS[table]
    split = {"tokens": tuple(c.name if not pa.types.is_list(c.type) else _leaf(c.name) for c in cols if c.is_float),
             "samples": tuple(c.name for c in cols if c.is_float)}.get(table, ())
    stats = tuple(c.name for c in cols if c.statistics)
    return WriteOptions(dictionary=tuple(c.name for c in cols if c.dictionary), byte_stream_split=split,
                        statistics=None if len(stats) == len(cols) else stats)


WRITE_OPTIONS: dict[str, WriteOptions] = {table: _write_options(table) for table in C.TABLE_COLUMNS}


def with_metadata(table: str, schema: pa.Schema | None = None) -> pa.Schema:
    """The schema of ``table`` with trustscope's metadata (table name, schema version) attached."""
    schema = SCHEMAS[table] if schema is None else schema
    meta = {"trustscope.table": table, "trustscope.schema_version": str(SCHEMA_VERSION)}
    if table in TABLE_VERSIONS:
        meta["trustscope.table_version"] = str(TABLE_VERSIONS[table])
    return schema.with_metadata(meta)


def is_data_file(path: Path) -> bool:
    """True for a finished Parquet file a reader should see (never a temporary one)."""
    return path.suffix == ".parquet" and not path.name.startswith(TMP_PREFIX)


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before the rename; it never matches ``*.parquet``."""
    return path.with_name(f"{TMP_PREFIX}{path.name}{TMP_SUFFIX}")


FLUSH_META_PREFIX = "trustscope.flush."
"""Every data file's footer holds its flush's number and the token counts the flush adds to the manifest
(``trustscope.flush.flush``, ``trustscope.flush.tokens_generated``, ...), so the counts can be rebuilt from the
files that remain when a run is cut back (:func:`trustscope.logger.drop_steps_after`)."""


def data_file_name(rank: int, first_step: int, last_step: int, flush: int, part: int | None = None) -> str:
    """The name of a file of one table written by flush ``flush`` of rank ``rank``; ``part`` numbers the files
    of one table that a flush writes in parallel (``-p<part>``), all committed together."""
    suffix = "" if part is None else f"-p{part:02d}"
    return f"r{rank:04d}-s{first_step:08d}-{last_step:08d}-f{flush:08d}{suffix}.parquet"


def compacted_file_name(rank: int, first_step: int, last_step: int, flushes: tuple[int, int],
                        part: int | None = None) -> str:
    """The name of a file that compaction (:mod:`trustscope.runformat.compaction`) wrote from the committed files of
    flushes ``flushes[0]..flushes[1]`` of rank ``rank``: ``r<rank>-s<first>-<last>-c<first flush>-<last flush>``.
    It is visible only while its rank's manifest lists it (:data:`COMPACTED_KEY`)."""
    suffix = "" if part is None else f"-p{part:02d}"
    return f"r{rank:04d}-s{first_step:08d}-{last_step:08d}-c{flushes[0]:08d}-{flushes[1]:08d}{suffix}.parquet"


DATA_FILE_RE = re.compile(r"^r(\d+)-s(\d+)-(\d+)-(?:f(\d+)(?:-p\d+)?|c(\d+)-(\d+)(?:-p\d+)?|.*)\.parquet$")


@dataclass(frozen=True)
class DataFileName:
    """What a data file's name says: its rank, its first and last step, and its flush (None: an older logger, or
    a compacted file, whose ``compacted`` is the range of flushes it replaces)."""

    rank: int
    first_step: int
    last_step: int
    flush: int | None
    compacted: tuple[int, int] | None = None


def parse_data_file(name: str) -> DataFileName | None:
    """The parts of a data file name (see :func:`data_file_name`), or None for a name the logger never writes."""
    m = DATA_FILE_RE.match(name)
    if m is None:
        return None
    compacted = None if m[5] is None else (int(m[5]), int(m[6]))
    return DataFileName(int(m[1]), int(m[2]), int(m[3]), None if m[4] is None else int(m[4]), compacted)


def rank_dir_name(rank: int) -> str:
    """The name of rank ``rank``'s folder inside each table folder (layout 2): ``r<rank>``, as its files begin."""
    return f"r{rank:04d}"


def is_rank_dir_name(name: str) -> bool:
    """Whether ``name`` (inside a table folder) is a rank folder's."""
    return RANK_DIR_RE.match(name) is not None


def rank_folder(run_dir: Path | PurePosixPath, table: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its files of ``table`` in a layout 2 run: ``<run>/<table>/r<rank>``."""
    return run_dir / table / rank_dir_name(rank)


def table_of(path: Path | PurePosixPath) -> str:
    """The table a data file belongs to: its folder, or its folder's folder for a file in a rank folder."""
    parent = path.parent
    return parent.parent.name if RANK_DIR_RE.match(parent.name) and parent.name not in TABLES else parent.name


def run_of(path: Path | PurePosixPath) -> Path | PurePosixPath:
    """The run directory a data file belongs to (its table folder's parent)."""
    parent = path.parent
    if RANK_DIR_RE.match(parent.name) and parent.name not in TABLES:
        parent = parent.parent
    return parent.parent


def is_vanished_file_error(err: BaseException) -> bool:
    """Whether ``err`` (DuckDB's, pyarrow's, the OS's) says a file listed a moment ago is gone: a compaction
    swapped the rank folder between the listing and the read. Reading again (listing again) is the cure."""
    if isinstance(err, FileNotFoundError):
        return True
    text = str(err)
    return any(s in text for s in ("No such file or directory", "No files found that match", "errno 2",
                                   "does not exist"))


def layout_of(manifest: dict) -> int:
    """The layout (:data:`LAYOUT`) a rank manifest says its run has: 1 when it says none (older loggers)."""
    value = manifest.get(LAYOUT_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def rank_manifest_paths(run_dir: Path) -> list[Path]:
    """Every rank's manifest: ``run.json`` (rank 0) and ``ranks/rank<r>.json``."""
    run_dir = Path(run_dir)
    return [run_dir / MANIFEST, *sorted((run_dir / RANKS_DIR).glob("rank*.json"))]


SCHEME = "s3://"


def rank_file(run_dir: Path | PurePosixPath, rank: int) -> Path:
    """Where rank ``rank`` keeps its status: ``run.json`` for rank 0, ``ranks/rank<r>.json`` for the others."""
    return run_dir / MANIFEST if rank == 0 else run_dir / RANKS_DIR / f"rank{rank:04d}.json"
