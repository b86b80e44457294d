"""The Arrow/Parquet writer: one open temporary file per table, finished by a rename."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trustscope import schema as S


class _Table:
    """One table's open temporary file and its pending rows (writer thread only)."""

    def __init__(self, name: str, row_group_size: int, prefix: str):
        self.name = name
        self.prefix = prefix
        self.schema = S.with_metadata(name)
        self.options = S.WRITE_OPTIONS[name]
        self.row_group_size = row_group_size
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.writer: pq.ParquetWriter | None = None
        self.tmp: Path | None = None
        self.rows = 0  # rows in the open file, written or pending
        self.first_step: int | None = None
        self.last_step: int | None = None

    def add(self, table: pa.Table, step: int, directory: Path) -> None:
        if table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if self.pending_rows >= self.row_group_size:
            self._write_pending(directory, whole_groups=True)

    def _write_pending(self, directory: Path, whole_groups: bool) -> None:
        data = pa.concat_tables(self.pending)
        keep = data.num_rows % self.row_group_size if whole_groups else 0
        if self.writer is None:
            self.tmp = S.tmp_path(directory / f"{self.prefix}-open-{secrets.token_hex(6)}.parquet")
            self.writer = pq.ParquetWriter(self.tmp, self.schema, **self.options.writer_kwargs())
        self.writer.write_table(data.slice(0, data.num_rows - keep), row_group_size=self.row_group_size)
        self.pending = [data.slice(data.num_rows - keep)] if keep else []
        self.pending_rows = keep

    def finish(self, directory: Path, name: str, fsync: bool) -> tuple[Path, int] | None:
        """Write what is pending, close the file and rename it to its final name. Returns (path, rows)."""
        if self.rows == 0:
            return None
        if self.pending_rows:
            self._write_pending(directory, whole_groups=False)
        assert self.writer is not None and self.tmp is not None
        self.writer.close()
        if fsync:
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        final = directory / name.format(first=self.first_step, last=self.last_step)
        os.replace(self.tmp, final)
        rows = self.rows
        self.reset()
        return final, rows

    def abort(self) -> None:
        """Drop the open file and pending rows (after a write error)."""
        if self.writer is not None:
            with contextlib.suppress(Exception):  # the file is being thrown away
                self.writer.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        self.reset()

    def reset(self) -> None:
        self.pending, self.pending_rows, self.writer, self.tmp = [], 0, None, None
        self.rows, self.first_step, self.last_step = 0, None, None


def _list_array(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    n, k = values.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)),
                                    type=pa.list_(pa.field("element", value_type, nullable=False)))


def round_mantissa(values: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``values`` rounded to ``bits`` mantissa bits (10 = float16's precision), still float32.

    The low ``23 - bits`` mantissa bits become zero, which BYTE_STREAM_SPLIT + zstd then store almost for free.
    Unlike a cast to float16 the float32 exponent is kept: no overflow, no loss for tiny magnitudes.
    Rounds half away from zero (on the magnitude).
    """
    drop = 23 - bits
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    half, keep = np.uint32(1 << (drop - 1)), np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    rounded = np.where(finite, (u + half) & keep, u)
    return rounded.view(np.float32)


def topk_divergences(mu_topk_logprobs: np.ndarray, pi_topk_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-K TV and KL ``(N,)`` float32 from ``(N, K)`` logprob arrays, by :mod:`trustscope.divergence`.

    Computed in float64: in float32 the 'other' bucket ``1 - sum P`` is lost below about 1e-3, and its log-ratio
    term of the KL with it.
    """
    import torch

    from trustscope import divergence

    mu = torch.from_numpy(np.asarray(mu_topk_logprobs, dtype=np.float64))
    pi = torch.from_numpy(np.asarray(pi_topk_logprobs, dtype=np.float64))
    with torch.no_grad():
        tv, kl = divergence.topk_tv(mu, pi), divergence.topk_kl(mu, pi)
    return tv.numpy().astype(np.float32), kl.numpy().astype(np.float32)
