"""The training thread never does the logger's storage work: Parquet encoding, fsync and the manifest write run on
the logger's own threads, never inside ``log_step`` or ``commit_step`` (docs/scale.md, "The trainer never waits on
storage")."""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import pyarrow.parquet as pq

from trustscope.logger import TokenLogger


class Watch:
    """Records on which thread each storage operation ran, and whether the training thread was inside a logger
    call at that moment."""

    def __init__(self) -> None:
        self.training = threading.current_thread()
        self.inside = False  # the training thread is inside log_step / commit_step
        self.on_training: list[str] = []
        self.elsewhere: Counter[str] = Counter()
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def seen(self, what: str) -> None:
        here = threading.current_thread()
        with self.lock:
            if here is self.training:
                if self.inside:
                    self.on_training.append(what)
            else:
                self.elsewhere[what] += 1
                self.threads.add(here.name)

    def wrap(self, what: str, fn):
        def wrapped(*args, **kwargs):
            self.seen(what)
            return fn(*args, **kwargs)

        return wrapped

    def call(self, fn, *args, **kwargs):
        self.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.inside = False


def test_parquet_encoding_fsync_and_the_manifest_never_run_on_the_calling_thread(tmp_path, monkeypatch):
    watch = Watch()
    monkeypatch.setattr(pq.ParquetWriter, "write_table", watch.wrap("parquet encode", pq.ParquetWriter.write_table))
    monkeypatch.setattr(pq.ParquetWriter, "close", watch.wrap("parquet footer", pq.ParquetWriter.close))
    monkeypatch.setattr(os, "fsync", watch.wrap("fsync", os.fsync))
    rng = np.random.default_rng(0)
    B, T = 8, 64
    # small flushes and a small memory bound: flushes rotate while calls come in, and log_step has to wait for
    # room (on_full="block"), the path where a blocked caller could be tempted to write itself
    with TokenLogger(tmp_path, "threads", flush_rows=2 * B * T, max_buffered_rows=3 * B * T, max_queue=2,
                     row_group_size=B * T, write_threads=2, on_full="block", block_timeout_s=None,
                     compact_every=2) as lg:
        store = type(lg._files.store)
        monkeypatch.setattr(store, "write_atomic", watch.wrap("manifest write", store.write_atomic))
        for step in range(12):
            mu = rng.normal(-1.0, 0.3, (B, T)).astype(np.float32)
            watch.call(lg.log_step, step, mask=np.ones((B, T), bool),
                       tokens={"token_id": rng.integers(0, 50, (B, T)), "mu_logprob": mu, "pi_logprob": mu + 0.01,
                               "advantage": rng.normal(size=B).astype(np.float32)},
                       samples={"prompt_id": np.arange(B) // 2, "reward": rng.random(B)},
                       scalars={"loss": float(step)})
            watch.call(lg.commit_step)
        lg.flush()
        assert lg.buffer["blocked_calls"] > 0, "the bound never made log_step wait: the test would not see that path"
        assert lg.manifest["committed_flush"] >= 6
    # every kind of storage work ran, on the logger's threads, and none inside a call of the training thread
    assert {"parquet encode", "parquet footer", "fsync", "manifest write"} <= set(watch.elsewhere), watch.elsewhere
    assert all(name.startswith("trustscope-") for name in watch.threads), watch.threads
    assert watch.on_training == [], watch.on_training
