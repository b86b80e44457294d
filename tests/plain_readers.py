"""Rows per step of a run's table as tools that know nothing of the manifests read it: DuckDB, pyarrow.dataset,
pandas and polars, each with its own reader over the table's folder (``docs/logging.md``, "Reading a run with
other tools"). A read that races a compaction's swap may find a file gone: it is read again, never counted wrong."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow.dataset as ds

from trustscope import runformat as S

READERS = ("duckdb", "pyarrow", "pandas", "polars")
TRIES = 50


def _files_in(folder: Path) -> bool:
    return any(folder.rglob("*.parquet"))


def _once(folder: Path, reader: str) -> dict[int, int]:
    if not _files_in(folder):  # DuckDB, pandas and polars refuse a folder without files; none is zero rows
        return {}
    glob = str(folder / "**" / "*.parquet")
    if reader == "duckdb":
        with duckdb.connect() as con:
            rows = con.execute("select step, count(*) from read_parquet(?) group by step", [glob]).fetchall()
        return dict(rows)
    if reader == "pyarrow":
        steps = ds.dataset(folder, format="parquet").to_table(columns=["step"])["step"].to_pylist()
        return dict(collections.Counter(steps))
    if reader == "pandas":
        return {int(k): int(v) for k, v in pd.read_parquet(folder, columns=["step"])["step"].value_counts().items()}
    if reader == "polars":
        # runs whose files come from logger versions with different columns: nulls for missing, extra ignored
        counted = pl.scan_parquet(glob, missing_columns="insert", extra_columns="ignore").group_by("step").len().collect()
        return dict(zip(counted["step"].to_list(), counted["len"].to_list(), strict=True))
    raise ValueError(f"unknown reader {reader!r}; known: {READERS}")


def step_counts(run_dir: Path, table: str, reader: str) -> tuple[dict[int, int], int]:
    """``(step -> rows, reads that failed on a file gone)`` of ``table`` as ``reader`` reads the folder."""
    for attempt in range(TRIES):
        try:
            return _once(Path(run_dir) / table, reader), attempt
        except Exception as err:
            if not S.is_vanished_file_error(err) or attempt == TRIES - 1:
                raise
            time.sleep(0.001)
    raise AssertionError("unreachable")


def trustscope_counts(run_dir: Path, table: str) -> dict[int, int]:
    """``step -> rows`` of ``table`` as trustscope's readers see it (the committed files)."""
    for attempt in range(TRIES):
        files = S.committed_files(Path(run_dir))[table]
        if not files:
            return {}
        try:
            steps = ds.dataset(files, format="parquet").to_table(columns=["step"])["step"].to_pylist()
            return dict(collections.Counter(steps))
        except FileNotFoundError:
            if attempt == TRIES - 1:
                raise
    raise AssertionError("unreachable")
