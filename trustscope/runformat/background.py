"""Compaction in the logger's own thread (:class:`BackgroundCompactor`, ``TokenLogger(compact_every=N)``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from trustscope.runformat.commits import COMPACTED_KEY
from trustscope.runformat.compaction import RankResult, compact_rank
from trustscope.runformat.errors import CompactionError, LogWarning
from trustscope.runformat.fsops import can_exchange
from trustscope.runformat.swap import DELETE_AFTER_S, drop_superseded


def background_compaction(files: Any, every: int) -> bool:
    """Whether the logger of ``files`` (a :class:`RunFiles`) compacts in the background with ``every``: only where
    a compaction swaps the rank folder atomically (a local layout 2 run on a file system with
    ``RENAME_EXCHANGE``), so that a plain reader never counts a row twice. Elsewhere it does not, with a
    warning on a local file system that cannot swap; ``trustscope compact`` compacts such logs later."""
    if not every:
        return False
    if files.store.remote:
        return False  # object stores: no swap; said in docs/logging.md, not at every open
    if files.layout < 2:
        return False  # a run of layout 1, resumed: its folders hold every rank's files, no folder to swap
    if not can_exchange(files.run_dir):
        import warnings


        warnings.warn(f"trustscope: {files.run_dir} is on a file system that cannot swap folders atomically "
                      f"(renameat2 RENAME_EXCHANGE: NFS, or not Linux); background compaction is off, so that "
                      f"readers of the folders never count a row twice. Run `trustscope compact` when no one reads.",
                      LogWarning, stacklevel=4)
        return False
    return True


class BackgroundCompactor:
    """The logger's compaction thread (``TokenLogger(compact_every=N)``): after every ``N`` commits of the rank it
    merges ``N`` units of a size class (:func:`plan`), beside the writer thread, which goes on writing and
    committing flushes. Both write the rank's manifest through :meth:`RunFiles.save` (serialised there): the writer
    its flushes, this thread only :data:`trustscope.runformat.commits.COMPACTED_KEY`. A failure leaves the log as it was and is
    kept for the training thread to warn about (:meth:`take_error`); the next round tries again."""

    def __init__(self, files: Any, every: int, row_group_size: int, fsync: bool,
                 delete_after_s: float = DELETE_AFTER_S):
        self.files, self.every = files, every
        self.row_group_size, self.fsync, self.delete_after_s = row_group_size, fsync, delete_after_s
        self.rounds = 0
        self.results: list[RankResult] = []
        self._commits = 0
        self._due = threading.Event()
        self._stop = threading.Event()
        self._finishing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"trustscope-compact-r{files.rank}", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Called by the writer thread after each commit."""
        self._commits += 1
        if self._commits >= self.every:
            self._due.set()

    def tidy(self) -> None:
        """At the logger's close: delete every folder the rank's compactions swapped out (no reader reaches them by
        path; whoever comes next would delete them anyway, and nobody may come)."""
        warnings: list[str] = []
        drop_superseded(Path(self.files.run_dir), self.files.rank, 0.0, None, warnings)
        if warnings and self._error is None:
            self._error = CompactionError("; ".join(warnings[:3]))

    def take_error(self) -> BaseException | None:
        err, self._error = self._error, None
        return err

    def stop(self, finish: bool = True) -> None:
        """End the thread. ``finish``: after the round in progress and one last round over the commits since
        (the logger's close leaves its files tidy); else at the next row group (an unfinished merge is dropped,
        nothing half-committed)."""
        if finish:
            self._finishing = True
        else:
            self._stop.set()
        self._due.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stop.is_set():
                return
            if self._finishing:
                if self._commits:
                    self._round()
                return
            self._commits = 0
            self._round()

    def _round(self) -> None:
        """Merge until nothing is left to merge: ``fanin`` units just merged may complete a class above."""
        try:
            while not self._stop.is_set():
                result = compact_rank(self.files.store, self.files.run_dir, self.files.rank, self.files.snapshot,
                                      lambda records: self.files.save(**{COMPACTED_KEY: records}), full=False,
                                      fanin=self.every, row_group_size=self.row_group_size, fsync=self.fsync,
                                      delete_after_s=self.delete_after_s, stop=self._stop,
                                      lock=self.files.folder_lock)
                self.rounds += 1
                self.results = [*self.results[-9:], result]
                if result.warnings:
                    self._error = CompactionError("; ".join(result.warnings[:3]))
                if not result.merged:
                    return
        except Exception as err:  # the log is as it was; the training thread hears of it
            self._error = err
