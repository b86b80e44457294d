"""Validation of a run or a log directory with clear errors: schemas, values, keys, manifests, row counts and compaction
records, each problem naming the file, the field and the value.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import columns as C
from trustscope.runformat.commits import committed_files, compaction_records, stray_files
from trustscope.runformat.errors import SchemaError
from trustscope.runformat.incidents import incident_problems
from trustscope.runformat.layout import (
    LOGPROB_TOLERANCE,
    MANIFEST,
    RANKS_DIR,
    SCHEMA_VERSION,
    SCHEMAS,
    STAGING_DIR,
    STATUSES,
    TABLE_VERSIONS,
    TABLES,
    TOPK_COLUMNS,
    VOCAB_FILE,
    parse_data_file,
    rank_dir_name,
    rank_manifest_paths,
)

ADDED_COLUMNS: dict[str, frozenset[str]] = C.added_columns()
"""Nullable columns added by a table version: files written before lack them, and readers see nulls there."""


KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("run_id", "step", "sample_id", "pos", "update_index"),
    "samples": ("run_id", "step", "sample_id"),
    "steps": ("run_id", "step", "rank", "name"),
    "summaries": ("run_id", "step", "rank", "part", "metric", "rule", "advantage_sign", "mu_low", "bin_low",
                  "dimension", "bucket"),
    "vocab": ("token_id",),
}
"""Columns that together are unique in each table (over all files and ranks of a run). A response trained by several
updates of one step has its rows once per ``update_index`` (null, one value of the key, in logs without it)."""


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
    problems += [Problem(path, m) for path, manifest in _readable_manifests(run_dir)
                 for m in incident_problems(manifest)]  # what the log itself went through (runformat.incidents)
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
    """Run directories under ``logdir``: ``logdir`` itself when it is a run (its ``run.json``, or the manifest of
    another rank when rank 0 never wrote one: the readers then name the missing ``run.json``, as they do when
    its log directory is given), else its children with a manifest or a table folder."""
    logdir = Path(logdir)
    if (logdir / MANIFEST).exists() or any((logdir / RANKS_DIR).glob("rank*.json")):
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
