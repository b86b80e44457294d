"""CPU seconds of a TokenLogger's own work, measured on the threads that do it (for the benchmarks).

Process CPU time compared between a run with logging and one without carries the machine's drift between the two
runs; thread CPU time of the logger's own work does not. :class:`LoggerCPU` wraps, for as long as it is installed:

- ``TokenLogger.log_step``: the caller's thread CPU inside the call (the checks, the copy of the caller's buffers);
- ``Writer._run``: the writer thread's CPU over its life (the summaries, the bits, the Arrow arrays, the sampling,
  and the Parquet encoding of the tables it encodes itself), read when the thread ends, which ``close`` waits for;
- ``pyarrow.parquet.ParquetWriter.write_table`` on the encoder threads (``trustscope-encode-*``): the token
  table's Parquet encoding where the logger hands it to those threads.

Every figure is read from ``time.thread_time`` on the thread that spent it.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class LoggerCPU:
    """Install with ``with LoggerCPU() as cpu:``; ``cpu.seconds()`` then reads ``{caller, writer thread,
    encoders}`` summed over every logger closed meanwhile (and calls of open ones)."""

    ENCODER_PREFIX = "trustscope-encode"

    def __init__(self) -> None:
        self.caller = 0.0
        self.writer = 0.0
        self.encoders = 0.0
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return {"caller": self.caller, "writer thread": self.writer, "encoders": self.encoders}

    def _add(self, field: str, seconds: float) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + seconds)

    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> LoggerCPU:
        import pyarrow.parquet as pq

        from trustscope.logger import TokenLogger
        from trustscope.logger.writer import Writer

        def on_thread(field: str, only_encoders: bool = False):
            def make(original):
                def timed(*args, **kwargs):
                    if only_encoders and not threading.current_thread().name.startswith(self.ENCODER_PREFIX):
                        return original(*args, **kwargs)  # encoded on the writer thread: counted there
                    start = time.thread_time()
                    try:
                        return original(*args, **kwargs)
                    finally:
                        self._add(field, time.thread_time() - start)
                return timed
            return make

        self._wrap(TokenLogger, "log_step", on_thread("caller"))
        self._wrap(Writer, "_run", on_thread("writer"))
        self._wrap(pq.ParquetWriter, "write_table", on_thread("encoders", only_encoders=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
