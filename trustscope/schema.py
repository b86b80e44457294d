"""Arrow schemas of the log tables, the on-disk layout, and validation with clear errors.

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
Compaction (:mod:`trustscope.logger.compaction`) rewrites consecutive committed flushes of a rank as one file per
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

import contextlib
import dataclasses
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

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
_RANK_DIR = re.compile(r"^r(\d+)$")

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

ADDED_COLUMNS: dict[str, frozenset[str]] = C.added_columns()
"""Nullable columns added by a table version: files written before lack them, and readers see nulls there."""

VOCAB = C.arrow_schema(C.VOCAB_COLUMNS)
"""Token id -> decoded text, so statistics can name tokens."""

SCHEMAS: dict[str, pa.Schema] = {"tokens": TOKENS, "samples": SAMPLES, "steps": STEPS, "summaries": SUMMARIES,
                                  "vocab": VOCAB}

KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("run_id", "step", "sample_id", "pos"),
    "samples": ("run_id", "step", "sample_id"),
    "steps": ("run_id", "step", "rank", "name"),
    "summaries": ("run_id", "step", "rank", "part", "metric", "rule", "advantage_sign", "mu_low", "bin_low",
                  "dimension", "bucket"),
    "vocab": ("token_id",),
}
"""Columns that together are unique in each table (over all files and ranks of a run)."""

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
    """The name of a file that compaction (:mod:`trustscope.logger.compaction`) wrote from the committed files of
    flushes ``flushes[0]..flushes[1]`` of rank ``rank``: ``r<rank>-s<first>-<last>-c<first flush>-<last flush>``.
    It is visible only while its rank's manifest lists it (:data:`COMPACTED_KEY`)."""
    suffix = "" if part is None else f"-p{part:02d}"
    return f"r{rank:04d}-s{first_step:08d}-{last_step:08d}-c{flushes[0]:08d}-{flushes[1]:08d}{suffix}.parquet"


_DATA_FILE_RE = re.compile(r"^r(\d+)-s(\d+)-(\d+)-(?:f(\d+)(?:-p\d+)?|c(\d+)-(\d+)(?:-p\d+)?|.*)\.parquet$")


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
    m = _DATA_FILE_RE.match(name)
    if m is None:
        return None
    compacted = None if m[5] is None else (int(m[5]), int(m[6]))
    return DataFileName(int(m[1]), int(m[2]), int(m[3]), None if m[4] is None else int(m[4]), compacted)


def rank_dir_name(rank: int) -> str:
    """The name of rank ``rank``'s folder inside each table folder (layout 2): ``r<rank>``, as its files begin."""
    return f"r{rank:04d}"


def is_rank_dir_name(name: str) -> bool:
    """Whether ``name`` (inside a table folder) is a rank folder's."""
    return _RANK_DIR.match(name) is not None


def rank_folder(run_dir: Path | PurePosixPath, table: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its files of ``table`` in a layout 2 run: ``<run>/<table>/r<rank>``."""
    return run_dir / table / rank_dir_name(rank)


def table_of(path: Path | PurePosixPath) -> str:
    """The table a data file belongs to: its folder, or its folder's folder for a file in a rank folder."""
    parent = path.parent
    return parent.parent.name if _RANK_DIR.match(parent.name) and parent.name not in TABLES else parent.name


def run_of(path: Path | PurePosixPath) -> Path | PurePosixPath:
    """The run directory a data file belongs to (its table folder's parent)."""
    parent = path.parent
    if _RANK_DIR.match(parent.name) and parent.name not in TABLES:
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


COMPACTED_KEY = "compacted"
"""Manifest key of a rank's compactions: a list of ``{"flushes": [first, last], "files": ["<table>/<name>", ...],
"at": <unix time>}``, one per compacted range (ranges never overlap). A flush file of the rank whose flush lies in
a listed range is superseded (never read: its rows are in the listed files), and a compacted file is read only
while a record lists it, so a compaction is committed, like a flush, by one atomic manifest write."""


@dataclass(frozen=True)
class Commits:
    """What the rank manifests commit: each rank's last committed flush (``marks``), the flush ranges its
    compactions supersede (``ranges``, sorted), the compacted files they list (``listed``: ``<folder>/<name>``,
    the folder relative to the run: ``tokens`` or ``tokens/r0000``) and each record as ``(rank, first flush, last
    flush, its files)`` (``records``)."""

    marks: dict[int, int]
    ranges: dict[int, tuple[tuple[int, int], ...]]
    listed: frozenset[str]
    records: tuple[tuple[int, int, int, frozenset[str]], ...] = ()
    landing: dict[tuple[int, int], frozenset[str]] = dataclasses.field(default_factory=dict)
    """(rank, flush) -> the files (relative to the run) of a committed flush being renamed into place
    (the manifest's ``publishing``): it is read once all of them are there, so a step shows in every table at
    once."""

    def visible(self, table: str, name: str) -> bool:
        """Whether a reader should see file ``name`` of folder ``table`` (relative to the run) with every
        compaction record in effect (see :meth:`select`, which decides that from the folder's listing)."""
        return self._visible(table, name, self.ranges)

    def select(self, folder: str, names: Iterable[str], present: set[str] | None = None) -> list[str]:
        """The names of one folder's listing that a reader should see, sorted. ``folder`` is relative to the run
        (``tokens``, or ``tokens/r0000``). A compaction record supersedes the flush files of its range in this
        folder only once every file it lists in this folder is there: a compaction records itself before its
        files land (the rank folder's swap, or an upload), and until then the flush files it replaces are read.
        ``present``: every file of the run's table folders (relative to the run); a flush being renamed into place
        (:attr:`landing`) is read once all its files are among them."""
        names = sorted(names)
        here = {f"{folder}/{n}" for n in names}
        present = here if present is None else present
        ranges: dict[int, list[tuple[int, int]]] = {}
        own = _RANK_DIR.match(folder.rpartition("/")[2]) if "/" in folder else None  # a rank folder: its rank's
        for rank, lo, hi, files in self.records:
            if own is not None and rank != int(own[1]):
                continue
            if all(f in here for f in files if f.rpartition("/")[0] == folder):
                ranges.setdefault(rank, []).append((lo, hi))
        effect = {rank: tuple(sorted(found)) for rank, found in ranges.items()}
        return [n for n in names if self._visible(folder, n, effect) and self._landed(n, present)]

    def _landed(self, name: str, present: set[str]) -> bool:
        if not self.landing:
            return True
        parsed = _DATA_FILE_RE.match(name)
        if parsed is None or parsed[4] is None:
            return True
        rank, flush = int(parsed[1]), int(parsed[4])
        files = self.landing.get((rank, flush))
        if files is None or files <= present:
            return True
        # compacted since it landed (a compaction takes only flushes whose files are all in place)
        return any(a <= flush <= b for a, b in self.ranges.get(rank, ()))

    def _visible(self, folder: str, name: str, ranges: dict[int, tuple[tuple[int, int], ...]]) -> bool:
        """A finished ``.parquet`` file (never a temporary one) that is either a compacted file some manifest
        lists, or a flush file whose flush is at most its rank's committed flush; in both cases not inside another
        range of ``ranges`` (the compactions in effect: a compaction that merges compacted files lists the old
        records until its own files are in place). Files without a flush number (older loggers) are visible in a
        table folder of layout 1, never in a rank folder; files of ranks without a mark are always visible."""
        if not name.endswith(".parquet") or name.startswith(TMP_PREFIX):
            return False
        parsed = _DATA_FILE_RE.match(name)
        flat = "/" not in folder  # a layout 1 table folder: files of older loggers, any name, are read
        if parsed is None:
            return flat
        rank = int(parsed[1])
        if parsed[5] is not None:
            lo, hi = int(parsed[5]), int(parsed[6])
            return f"{folder}/{name}" in self.listed and not any(
                a <= lo and hi <= b and (a, b) != (lo, hi) for a, b in ranges.get(rank, ()))
        if parsed[4] is None:
            return flat
        flush = int(parsed[4])
        if rank in self.marks and flush > self.marks[rank]:
            return False
        return not any(a <= flush <= b for a, b in ranges.get(rank, ()))


def read_commits(manifests: Iterable[bytes]) -> Commits:
    """The :class:`Commits` of a run from its rank manifests' bytes; unreadable manifests give nothing, manifests
    without a ``committed_flush`` (older loggers) give no mark."""
    marks: dict[int, int] = {}
    ranges: dict[int, tuple[tuple[int, int], ...]] = {}
    listed: set[str] = set()
    records = []
    landing: dict[tuple[int, int], set[str]] = {}
    for data in manifests:
        try:
            manifest = json.loads(data)
        except ValueError:
            continue
        if not isinstance(manifest, dict):
            continue
        rank = manifest.get("rank", 0)
        rank = rank if isinstance(rank, int) else 0
        if isinstance(manifest.get("committed_flush"), int):
            marks[rank] = manifest["committed_flush"]
        found = []
        for record in compaction_records(manifest):
            found.append((record["flushes"][0], record["flushes"][1]))
            files = frozenset(f for f in record["files"] if (name := parse_data_file(f.rpartition("/")[2]))
                              is not None and name.rank == rank and name.compacted is not None)
            listed.update(files)
            records.append((rank, record["flushes"][0], record["flushes"][1], files))
        if found:
            ranges[rank] = tuple(sorted(found))
        for final in publishing_files(manifest):
            name = parse_data_file(final.rpartition("/")[2])
            if name is not None and name.flush is not None:
                landing.setdefault((rank, name.flush), set()).add(final)
    return Commits(marks, ranges, frozenset(listed), tuple(records),
                   {k: frozenset(v) for k, v in landing.items()})


def publishing_entries(manifest: dict) -> list[list]:
    """The well-formed ``publishing`` entries of a parsed rank manifest, ``[temporary, final, rows]`` with the names
    relative to the run: the files of a committed flush still being renamed into place (malformed ones ignored)."""
    return [entry for entry in manifest.get("publishing") or ()
            if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], str)]


def publishing_files(manifest: dict) -> list[str]:
    """The final names (relative to the run) of :func:`publishing_entries`."""
    return [entry[1] for entry in publishing_entries(manifest)]


def compaction_records(manifest: dict) -> list[dict]:
    """The well-formed records of a parsed rank manifest's :data:`COMPACTED_KEY` (others are ignored)."""
    out = []
    for record in manifest.get(COMPACTED_KEY) or ():
        flushes = record.get("flushes") if isinstance(record, dict) else None
        files = record.get("files") if isinstance(record, dict) else None
        if (isinstance(flushes, list) and len(flushes) == 2 and all(isinstance(f, int) for f in flushes)
                and isinstance(files, list) and all(isinstance(f, str) for f in files)):
            out.append(record)
    return out


def committed_marks(manifests: Iterable[bytes]) -> dict[int, int]:
    """rank -> the last flush its manifest committed, from the manifests' bytes; unreadable manifests and
    manifests without a ``committed_flush`` (older loggers) give no mark."""
    return read_commits(manifests).marks


def is_committed(name: str, marks: dict[int, int] | Commits, table: str | None = None) -> bool:
    """Whether a reader should see the file ``name`` of folder ``table`` (see :meth:`Commits.visible`); with bare
    ``marks`` (no compaction records) compacted files are never visible."""
    commits = marks if isinstance(marks, Commits) else Commits(marks, {}, frozenset())
    return commits.visible(table or "", name)


def _read_all(paths: Iterable[str]) -> list[bytes]:
    texts = []
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            texts.append(f.read())
    return texts


def _manifest_paths(run_dir: str) -> list[str]:
    paths = [os.path.join(run_dir, MANIFEST)]
    with contextlib.suppress(OSError):
        paths += [e.path for e in os.scandir(os.path.join(run_dir, RANKS_DIR))
                  if e.name.startswith("rank") and e.name.endswith(".json")]
    return paths


def _committed_flushes(run_dir: str) -> dict[int, int]:
    """rank -> the last flush its manifest committed, for the ranks whose (readable) manifest records one."""
    return committed_marks(_read_all(_manifest_paths(run_dir)))


LISTING_TRIES = 5
"""How often :func:`committed_files` lists again when a compaction commits while it lists."""


def table_listing(run_dir: Path, table: str) -> dict[str, list[str]]:
    """What one table folder of a local run holds: folder relative to the run (``tokens``, ``tokens/r0000``, ...)
    -> the names of the files in it (the table folder's own files, layout 1, and each rank folder's, layout 2).
    A missing folder holds nothing; a rank folder swapped while it is listed is listed whole, before or after."""
    out: dict[str, list[str]] = {}
    try:
        entries = list(os.scandir(run_dir / table))
    except (FileNotFoundError, NotADirectoryError):
        return out
    flat = []
    for entry in entries:
        if _RANK_DIR.match(entry.name):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                out[f"{table}/{entry.name}"] = [e.name for e in os.scandir(entry.path)]
        else:
            flat.append(entry.name)
    out[table] = flat
    return out


def committed_files(run_dir: Path | PurePosixPath, fs: Any = None) -> dict[str, list[Path]]:
    """The files of each table a reader should see, sorted: finished files that a rank manifest commits
    (:meth:`Commits.select`): flush files of committed flushes that no compaction in effect superseded, and the
    compacted files the manifests list, in the table folders (layout 1) and their rank folders (layout 2).

    A file whose flush number is above its rank's ``committed_flush`` is one no manifest commits (a writer of an
    older version died between its renames and its commit, or the file was copied in by hand): it is never read,
    ``validate`` names it, and the next writer of the rank, ``trustscope compact`` and ``validate --repair``
    remove it. Files without a flush number (older loggers) are always read.
    The manifests are read before the folders are listed and again after: when a compaction committed meanwhile,
    the run is listed again. Local runs are listed with ``os.scandir`` (this is called for every query cursor); no
    file is opened but the manifests. With ``fs`` (a ``pyarrow.fs.FileSystem``, e.g. an object store), ``run_dir``
    is a path on it and the paths returned are ``PurePosixPath``s on it.
    """
    if fs is not None:
        return _committed_files_on(fs, PurePosixPath(run_dir))
    run_dir = Path(run_dir)
    paths = _manifest_paths(str(run_dir))
    before = _read_all(paths)
    for _ in range(LISTING_TRIES):
        commits = read_commits(before)
        listings = {table: table_listing(run_dir, table) for table in TABLES}
        present = {f"{folder}/{n}" for found in listings.values() for folder, names in found.items() for n in names}
        out: dict[str, list[Path]] = {}
        for table in TABLES:
            out[table] = [run_dir / folder / name for folder, names in sorted(listings[table].items())
                          for name in commits.select(folder, names, present)]
        after = _read_all(_manifest_paths(str(run_dir)))
        if after == before or _same_compactions(before, after):
            return out
        before = after
    return out


def _same_compactions(before: list[bytes], after: list[bytes]) -> bool:
    """Whether two readings of a run's manifests commit the same compactions (flush commits may differ: files of a
    later flush are simply not read)."""
    a, b = read_commits(before), read_commits(after)
    return a.ranges == b.ranges and a.listed == b.listed


def _committed_files_on(fs: Any, run_dir: PurePosixPath) -> dict[str, list[Path]]:
    from pyarrow.fs import FileSelector, FileType

    def entries(folder: PurePosixPath) -> list[Any]:
        return fs.get_file_info(FileSelector(str(folder), allow_not_found=True))

    def names(folder: PurePosixPath) -> list[str]:
        return [PurePosixPath(i.path).name for i in entries(folder) if i.type == FileType.File]

    def manifests() -> list[bytes]:
        paths = [run_dir / MANIFEST]
        paths += [run_dir / RANKS_DIR / n for n in names(run_dir / RANKS_DIR)
                  if n.startswith("rank") and n.endswith(".json")]
        texts = []
        for path in paths:
            with contextlib.suppress(FileNotFoundError, OSError), fs.open_input_stream(str(path)) as f:
                texts.append(f.read())
        return texts

    def listing(table: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {table: []}
        for info in entries(run_dir / table):
            name = PurePosixPath(info.path).name
            if info.type == FileType.File:
                out[table].append(name)
            elif _RANK_DIR.match(name):
                out[f"{table}/{name}"] = names(run_dir / table / name)
        return out

    before = manifests()
    for _ in range(LISTING_TRIES):
        commits = read_commits(before)
        listings = {table: listing(table) for table in TABLES}
        present = {f"{folder}/{n}" for found in listings.values() for folder, names in found.items() for n in names}
        out = {table: [run_dir / folder / n for folder, found in sorted(listings[table].items())
                       for n in commits.select(folder, found, present)] for table in TABLES}
        after = manifests()
        if after == before or _same_compactions(before, after):
            return out
        before = after
    return out


def readable_set(run_dir: Path) -> dict[str, list[Path]]:
    """Every file of each table that a plain reader of the folders may read: each ``*.parquet`` file under the
    table folder, at any depth (DuckDB's ``<table>/**/*.parquet``; pyarrow, pandas and Spark read the same less
    the names they skip, ``.`` and ``_`` prefixes)."""
    out: dict[str, list[Path]] = {}
    for table in TABLES:
        found = []
        for folder, dirs, files in os.walk(run_dir / table):
            dirs.sort()
            found += [Path(folder) / f for f in files if f.endswith(".parquet")]
        out[table] = sorted(found)
    return out


@dataclass(frozen=True)
class Stray:
    """A file in a table folder that plain readers read but no manifest commits (:func:`stray_files`)."""

    path: Path
    why: str
    removable: bool
    """Provably superseded (its rows are in a compacted file that is read) or orphaned (a flush no manifest
    commits, a compacted file no manifest lists): ``validate --repair`` removes it. A name the logger never
    writes (a hand-copied file) is only named."""


def stray_files(run_dir: Path, visible: dict[str, list[Path]] | None = None) -> list[Stray]:
    """The files of :func:`readable_set` that :func:`committed_files` does not read, each with why."""
    run_dir = Path(run_dir)
    visible = committed_files(run_dir) if visible is None else visible
    read = {p for files in visible.values() for p in files}
    commits = read_commits(_read_all(_manifest_paths(str(run_dir))))
    out = []
    for files in readable_set(run_dir).values():
        originals: dict[Path, set[str]] = {}
        for path in files:
            if path in read:
                continue
            name = parse_data_file(path.name)
            folder = path.parent.relative_to(run_dir).as_posix()
            if name is None or path.name.startswith(TMP_PREFIX) or folder.count("/") > 1:
                out.append(Stray(path, "not a file the logger writes (copied in by hand?)", False))
            elif name.compacted is not None:
                out.append(Stray(path, f"a compacted file of rank {name.rank} that no manifest lists (left by a "
                                       f"compaction that did not finish)", True))
            elif name.flush is None:
                out.append(Stray(path, "not a file the logger writes (copied in by hand?)", False))
            elif (name.rank, name.flush) in commits.landing:
                out.append(Stray(path, f"flush {name.flush} of rank {name.rank} is committed but not all its files "
                                       f"are in place (a writer killed while renaming them); the next writer of "
                                       f"the rank or `trustscope validate --repair` puts the rest in place", False))
            elif name.rank in commits.marks and name.flush > commits.marks[name.rank]:
                out.append(Stray(path, f"flush {name.flush} of rank {name.rank}, which its manifest never "
                                       f"committed (committed_flush {commits.marks[name.rank]}): a writer died "
                                       f"before its commit", True))
            else:
                holders = [p for p in read if p.parent == path.parent and (n := parse_data_file(p.name)) is not None
                           and n.rank == name.rank and n.compacted is not None
                           and n.compacted[0] <= name.flush <= n.compacted[1]]
                proven = False
                for holder in holders:
                    if holder not in originals:
                        try:
                            meta = pq.read_metadata(holder).metadata or {}
                            originals[holder] = {o[0] for o in json.loads(meta.get(b"trustscope.compacted.originals",
                                                                                     b"[]"))}
                        except (OSError, ValueError, pa.ArrowException):
                            originals[holder] = set()
                    proven = proven or path.name in originals[holder]
                if proven:
                    out.append(Stray(path, f"superseded: its rows are in the compacted file {holders[0].name}, "
                                           f"which is read", True))
                else:
                    out.append(Stray(path, f"flush {name.flush} of rank {name.rank}, which a compaction record "
                                           f"supersedes, but no compacted file read holds its rows", False))
    return out


# ---------------------------------------------------------------------------------------------------- validation


class SchemaError(ValueError):
    """A value, column or file that breaks the log schema. The message names the field and the value."""


@dataclass(frozen=True)
class Problem:
    """One problem found by :func:`validate_logdir`: the file it is in and what is wrong."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def schema_problems(table: str, schema: pa.Schema, extra: tuple[C.Column, ...] = ()) -> list[str]:
    """Differences between ``schema`` and table ``table``'s schema (with the run's own columns ``extra``, see
    :func:`run_extra_columns`): missing, extra, mistyped columns."""
    expected = SCHEMAS[table]
    if extra:
        expected = pa.schema([*expected, *(c.field for c in extra)])
    problems = []
    for field in expected:
        idx = schema.get_field_index(field.name)
        if idx < 0:
            if field.name not in ADDED_COLUMNS.get(table, ()):
                problems.append(f"column {field.name!r} is missing (expected {field.type})")
            continue
        got = schema.field(idx).type
        if pa.types.is_dictionary(got):
            got = got.value_type
        if not got.equals(field.type, check_metadata=False) and not _same_list_type(got, field.type):
            problems.append(f"column {field.name!r} has type {got}, expected {field.type}")
    for name in schema.names:
        if expected.get_field_index(name) < 0:
            problems.append(f"unknown column {name!r} (table {table!r} has {expected.names})")
    if schema.metadata is not None:
        version = schema.metadata.get(b"trustscope.schema_version")
        if version is not None and version.decode() != str(SCHEMA_VERSION):
            problems.append(f"schema_version {version.decode()!r} in file metadata, expected {SCHEMA_VERSION}")
        table_version = schema.metadata.get(b"trustscope.table_version")
        if table in TABLE_VERSIONS and table_version is not None and not (
                table_version.decode().isdigit() and int(table_version.decode()) <= TABLE_VERSIONS[table]):
            problems.append(f"table_version {table_version.decode()!r} of table {table!r} in file metadata, "
                            f"expected at most {TABLE_VERSIONS[table]}")
    return problems


def _same_list_type(a: pa.DataType, b: pa.DataType) -> bool:
    return (
        (pa.types.is_list(a) or pa.types.is_large_list(a))
        and pa.types.is_list(b)
        and a.value_type.equals(b.value_type)
    )


def value_problems(table: str, data: pa.Table) -> list[str]:
    """Values that break the contract: nulls in non-nullable columns, bad logprobs, ragged top-K lists, values
    outside their column's declared check (:mod:`trustscope.columns`)."""
    import pyarrow.compute as pc

    schema = SCHEMAS[table]
    problems = []
    for field in schema:
        if field.name in data.column_names and not field.nullable and data.column(field.name).null_count:
            problems.append(f"column {field.name!r} has {data.column(field.name).null_count} null(s)")
    if table != "tokens":
        return problems
    for col in C.TOKEN_COLUMNS:
        if col.check is None or col.name not in data.column_names:
            continue
        values = data.column(col.name)
        if pa.types.is_list(col.type):
            values = pc.list_flatten(values)
        if col.check.kind == "logprob":
            problems += _logprob_problems(col.name, values)
        elif col.check.kind == "version" and "step" in data.column_names:
            bad = _count(pc.or_(pc.less(values, 0), pc.greater(values, data.column("step"))))
            if bad:
                problems.append(f"column {col.name!r} has {bad} value(s) below 0 or above the row's step")
        elif col.check.kind == "turn":
            bad = _count(pc.less(values, 0))
            if bad:
                problems.append(f"column {col.name!r} has {bad} negative value(s)")
    lengths = {
        name: pc.list_value_length(data.column(name)) for name in TOPK_COLUMNS if name in data.column_names
    }
    if lengths:
        ref_name, ref = next(iter(lengths.items()))
        for name, other in lengths.items():
            both = pc.and_(pc.is_valid(ref), pc.is_valid(other))
            differ = pc.sum(pc.cast(pc.and_(both, pc.not_equal(ref, other)), pa.int64())).as_py() or 0
            if differ:
                problems.append(f"{name} and {ref_name} lists differ in length on {differ} row(s)")
        ks = pc.unique(pc.drop_null(ref)).to_pylist()
        if len(ks) > 1:
            problems.append(f"{ref_name} has lists of several lengths {sorted(ks)[:10]}: K must be fixed")
    if "entropy" in data.column_names:
        bad = _count(pc.or_(pc.invert(pc.is_finite(data.column("entropy"))), pc.less(data.column("entropy"), 0)))
        if bad:
            problems.append(f"column 'entropy' has {bad} negative or non-finite value(s)")
    return problems


def _count(mask: pa.ChunkedArray | pa.Array) -> int:
    """How many values of a boolean ``mask`` are true (nulls are not)."""
    import pyarrow.compute as pc

    return int(pc.sum(mask).as_py() or 0)


def _logprob_problems(name: str, col: pa.ChunkedArray | pa.Array) -> list[str]:
    import pyarrow.compute as pc

    problems = []
    nonfinite = _count(pc.invert(pc.is_finite(col)))
    if nonfinite:
        problems.append(f"column {name!r} has {nonfinite} NaN or infinite value(s)")
    positive = _count(pc.greater(col, LOGPROB_TOLERANCE))
    if positive:
        problems.append(f"column {name!r} has {positive} positive value(s) (max {pc.max(col).as_py()})")
    return problems


def read_manifest(run_dir: Path) -> dict:
    """The parsed ``run.json`` of ``run_dir``; raises :class:`SchemaError` naming the file when unreadable."""
    path = Path(run_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise SchemaError(f"{path}: no run manifest") from None
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: unreadable run manifest ({err})") from None
    if not isinstance(manifest, dict):
        raise SchemaError(f"{path}: run manifest is {type(manifest).__name__}, expected a JSON object")
    return manifest


def manifest_problems(manifest: dict, run_dir: Path) -> list[str]:
    """What is wrong with a parsed manifest: missing keys, a foreign schema version, an unknown status."""
    problems = []
    for key in ("run_id", "schema_version", "status"):
        if key not in manifest:
            problems.append(f"manifest has no {key!r}")
    if manifest.get("run_id") not in (None, run_dir.name):
        problems.append(f"manifest run_id {manifest['run_id']!r} differs from the directory name {run_dir.name!r}")
    if "schema_version" in manifest and manifest["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version {manifest['schema_version']!r}, this trustscope reads {SCHEMA_VERSION}")
    if "status" in manifest and manifest["status"] not in STATUSES:
        problems.append(f"status {manifest['status']!r} is not one of {STATUSES}")
    return problems


def run_extra_columns(manifest: dict) -> tuple[C.Column, ...]:
    """The run's own per-token columns its manifest declares (``logging.extra_columns``, see
    :func:`trustscope.columns.extra_columns`); none for a manifest without them or with a declaration this
    trustscope cannot read."""
    logging_info = manifest.get("logging") if isinstance(manifest, dict) else None
    declared = logging_info.get("extra_columns") if isinstance(logging_info, dict) else None
    try:
        return C.extra_columns(declared or None)
    except ValueError:
        return ()


def validate_file(path: Path, table: str, run_id: str | None = None,
                  extra: tuple[C.Column, ...] = ()) -> list[str]:
    """Problems of one Parquet file of table ``table``: unreadable, wrong schema, bad values, foreign run_id.
    ``extra``: the run's own tokens columns (:func:`run_extra_columns`)."""
    import pyarrow.compute as pc

    try:
        data = pq.ParquetFile(path).read()  # not read_table: its dataset layer imports pandas
    except Exception as err:  # any reader error means the file is not usable Parquet
        return [f"not readable as Parquet ({type(err).__name__}: {err})"]
    problems = schema_problems(table, data.schema, extra)
    present = [f.name for f in SCHEMAS[table] if f.name in data.column_names]
    problems += value_problems(table, data.select(present))
    if run_id is not None and "run_id" in data.column_names:
        others = [v for v in pc.unique(data.column("run_id")).to_pylist() if v != run_id]
        if others:
            problems.append(f"run_id {others[0]!r} in a file of run {run_id!r}")
    return problems


def _key_problems(table: str, files: list[Path]) -> list[str]:
    """Duplicate keys over all readable files of one table of one run, naming the ranks that wrote them."""
    import pyarrow.compute as pc

    cols = list(KEYS[table])
    read_cols = [*cols, "rank"] if "rank" not in cols and "rank" in SCHEMAS[table].names else cols
    parts = []
    for path in files:
        try:
            part = pq.ParquetFile(path).read(columns=read_cols)
        except Exception:  # reported by validate_file already
            continue
        for name in read_cols:  # a key column added by a later table version: null in older files
            if name not in part.column_names and name in ADDED_COLUMNS.get(table, ()):
                part = part.append_column(SCHEMAS[table].field(name), pa.nulls(part.num_rows,
                                                                               SCHEMAS[table].field(name).type))
        parts.append(part.select(read_cols))
    if not parts:
        return []
    try:
        keys = pa.concat_tables(parts, promote_options="permissive")
    except pa.ArrowInvalid:
        return []
    aggs = [([], "count_all")] + ([("rank", "min"), ("rank", "max")] if read_cols != cols else [])
    counts = keys.group_by(cols).aggregate(aggs)
    dup = counts.filter(pc.greater(counts.column("count_all"), 1))
    if dup.num_rows == 0:
        return []
    first = {c: dup.column(c)[0].as_py() for c in cols}
    message = f"{dup.num_rows} duplicate key(s) {tuple(cols)}, e.g. {first}"
    if read_cols != cols:
        across = pc.not_equal(dup.column("rank_min"), dup.column("rank_max"))
        if _count(across):
            i = pc.index(across, True).as_py()
            ranks = (dup.column("rank_min")[i].as_py(), dup.column("rank_max")[i].as_py())
            message += (f"; {_count(across)} of them collide across ranks (e.g. ranks {ranks[0]} and {ranks[1]} "
                        f"both wrote {({c: dup.column(c)[i].as_py() for c in cols})}): sample_id must be unique "
                        f"within a step over all ranks")
    return [message]


def _readable_manifests(run_dir: Path) -> Iterator[tuple[Path, dict]]:
    """Each rank manifest of ``run_dir`` that reads as a JSON object, with its path (an unreadable one is reported
    by the manifest check)."""
    for path in rank_manifest_paths(run_dir):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(manifest, dict):
            yield path, manifest


def _row_count_problems(run_dir: Path, files: dict[str, list[Path]]) -> list[Problem]:
    """Where a rank's manifest ``rows`` disagree with the rows of the files a reader sees."""
    problems = []
    for path, manifest in _readable_manifests(run_dir):
        rows = manifest.get("rows")
        if not isinstance(rows, dict):
            continue
        rank = int(manifest.get("rank", 0))
        for table in TABLES:
            counted: int | None = 0
            for file in files[table]:
                name = parse_data_file(file.name)
                if name is None or name.rank != rank or counted is None:
                    continue
                try:
                    counted += pq.ParquetFile(file).metadata.num_rows
                except Exception:  # an unreadable file, reported by validate_file already: nothing to compare
                    counted = None
            if counted is not None and rows.get(table, 0) != counted:
                problems.append(Problem(path, f"manifest of rank {rank} counts {rows.get(table, 0)} {table} row(s), "
                                              f"the run's {table} files of rank {rank} hold {counted}"))
    return problems


def _compaction_problems(run_dir: Path) -> list[Problem]:
    """Compaction records (:data:`COMPACTED_KEY`) whose flush ranges overlap, or whose listed files are gone.
    Two states of a compaction killed halfway are not problems (readers read the run right, and the next writer
    of the rank, ``trustscope compact`` and ``validate --repair`` finish it): a record whose files are still staged
    under ``_staging``, and a record listed beside the larger one that replaced it."""
    problems = []
    for path, manifest in _readable_manifests(run_dir):
        rank = manifest.get("rank", 0)
        records = sorted(compaction_records(manifest), key=lambda r: r["flushes"][0])
        for before, after in itertools.pairwise(records):
            (a, b), (c, d) = before["flushes"], after["flushes"]
            nested = (a <= c and d <= b) or (c <= a and b <= d)
            if after["flushes"][0] <= before["flushes"][1] and not nested:
                problems.append(Problem(path, f"compacted flush ranges {before['flushes']} and {after['flushes']} "
                                              f"overlap"))
        for record in records:
            lo, hi = record["flushes"]
            staged = (run_dir / STAGING_DIR / f"{rank_dir_name(rank if isinstance(rank, int) else 0)}"
                      f"-c{lo:08d}-{hi:08d}").is_dir()
            replaced = any(r is not record and r["flushes"][0] <= lo and hi <= r["flushes"][1] for r in records)
            for rel in record["files"]:
                if not (run_dir / rel).is_file() and not staged and not replaced:
                    problems.append(Problem(path, f"compacted file {rel} is listed but missing"))
    return problems


def validate_run(run_dir: Path) -> list[Problem]:
    """Every problem of one run directory, each with the file it is in."""
    run_dir = Path(run_dir)
    problems: list[Problem] = []
    manifest_path = run_dir / MANIFEST
    extra: tuple[C.Column, ...] = ()
    try:
        manifest = read_manifest(run_dir)
        problems += [Problem(manifest_path, m) for m in manifest_problems(manifest, run_dir)]
        extra = run_extra_columns(manifest)
    except SchemaError as err:
        problems.append(Problem(manifest_path, str(err).removeprefix(f"{manifest_path}: ")))
    for path in sorted((run_dir / RANKS_DIR).glob("rank*.json")):
        try:
            rank_manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            problems.append(Problem(path, f"unreadable rank manifest ({err})"))
            continue
        status = rank_manifest.get("status") if isinstance(rank_manifest, dict) else None
        if status not in STATUSES:
            problems.append(Problem(path, f"status {status!r} is not one of {STATUSES}"))
    run_id = run_dir.name
    visible = committed_files(run_dir)
    for table in TABLES:
        files = visible[table]
        for path in files:
            own = extra if table == "tokens" else ()
            problems += [Problem(path, m) for m in validate_file(path, table, run_id, own)]
        problems += [Problem(run_dir / table, m) for m in _key_problems(table, files)]
    problems += _row_count_problems(run_dir, visible)
    problems += _compaction_problems(run_dir)
    for stray in stray_files(run_dir, visible):
        fix = "; `trustscope validate --repair` removes it" if stray.removable else ""
        problems.append(Problem(stray.path, f"read by tools that list the folder (DuckDB, pyarrow, pandas, polars, "
                                            f"Spark) but by no manifest: {stray.why}{fix}"))
    vocab = run_dir / VOCAB_FILE
    if vocab.exists():
        problems += [Problem(vocab, m) for m in validate_file(vocab, "vocab")]
        problems += [Problem(vocab, m) for m in _key_problems("vocab", [vocab])]
    return problems


def run_dirs(logdir: Path) -> list[Path]:
    """Run directories under ``logdir``: ``logdir`` itself when it is a run, else its children with a manifest."""
    logdir = Path(logdir)
    if (logdir / MANIFEST).exists():
        return [logdir]
    return sorted(p for p in logdir.iterdir() if p.is_dir() and _looks_like_run(p))


def _looks_like_run(path: Path) -> bool:
    return (path / MANIFEST).exists() or any((path / t).is_dir() for t in TABLES)


def validate_logdir(logdir: Path) -> list[Problem]:
    """Every problem of every run under ``logdir`` (a log directory or one run directory)."""
    logdir = Path(logdir)
    if not logdir.is_dir():
        return [Problem(logdir, "not a directory")]
    runs = run_dirs(logdir)
    if not runs:
        return [Problem(logdir, "no run found (expected <run_id>/run.json)")]
    problems: list[Problem] = []
    for run in runs:
        problems += validate_run(run)
    return problems
