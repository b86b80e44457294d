"""What the rank manifests commit, and so what a reader reads: :class:`Commits` (committed flushes, the compactions in
effect, the flushes being published), :func:`committed_files` (the one listing every reader uses) and the files that
plain readers see but no manifest commits (:func:`stray_files`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trustscope.runformat.layout import (
    DATA_FILE_RE,
    MANIFEST,
    RANK_DIR_RE,
    RANKS_DIR,
    TABLES,
    TMP_PREFIX,
    parse_data_file,
)

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
        own = RANK_DIR_RE.match(folder.rpartition("/")[2]) if "/" in folder else None  # a rank folder: its rank's
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
        parsed = DATA_FILE_RE.match(name)
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
        parsed = DATA_FILE_RE.match(name)
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


def read_all(paths: Iterable[str]) -> list[bytes]:
    texts = []
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            texts.append(f.read())
    return texts


def manifest_paths(run_dir: str) -> list[str]:
    paths = [os.path.join(run_dir, MANIFEST)]
    with contextlib.suppress(OSError):
        paths += [e.path for e in os.scandir(os.path.join(run_dir, RANKS_DIR))
                  if e.name.startswith("rank") and e.name.endswith(".json")]
    return paths


def _committed_flushes(run_dir: str) -> dict[int, int]:
    """rank -> the last flush its manifest committed, for the ranks whose (readable) manifest records one."""
    return committed_marks(read_all(manifest_paths(run_dir)))


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
        if RANK_DIR_RE.match(entry.name):
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
    paths = manifest_paths(str(run_dir))
    before = read_all(paths)
    for _ in range(LISTING_TRIES):
        commits = read_commits(before)
        listings = {table: table_listing(run_dir, table) for table in TABLES}
        present = {f"{folder}/{n}" for found in listings.values() for folder, names in found.items() for n in names}
        out: dict[str, list[Path]] = {}
        for table in TABLES:
            out[table] = [run_dir / folder / name for folder, names in sorted(listings[table].items())
                          for name in commits.select(folder, names, present)]
        after = read_all(manifest_paths(str(run_dir)))
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
            elif RANK_DIR_RE.match(name):
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
    commits = read_commits(read_all(manifest_paths(str(run_dir))))
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
