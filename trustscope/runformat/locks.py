"""The lock a rank writer holds on its run (:class:`RunLock`, an ``flock`` on the rank's lock file with the owner's pid and
start time, so a lock whose owner died is taken over) and :class:`NoLock`, what an object store run has instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path

from trustscope.runformat.errors import LogDirError, LogWarning
from trustscope.runformat.layout import TMP_PREFIX
from trustscope.runformat.manifest import now


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks (Linux), to tell a live writer from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return process_start(pid) == start
    return True


NO_LOCKS = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK})
"""flock errors of file systems that offer no locks (e.g. Lustre mounted ``noflock``): logging goes on, unlocked."""


INHERITED_LOCK_WAIT_S = 10.0
"""Seconds :meth:`RunLock.acquire` waits for a lock whose owner is gone (no process of its pid on this host) but
that a process it forked still holds (a child between its fork and its exec, a data loader worker): the lock
outlives its owner until that process ends."""


class RunLock:
    """An exclusive lock on ``<run>/.r<rank>.lock`` while a logger writes that rank; the file names the owner.

    An ``flock``: the kernel drops it when its process dies, so the lock of a dead writer is taken over at once.
    The file is removed on release; a lock taken on a file that was removed meanwhile is taken again.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.path = run_dir / f"{TMP_PREFIX}r{rank:04d}.lock"
        self._fd: int | None = None

    def acquire(self, run_id: str, rank: int) -> None:
        """Take the lock, or raise LogDirError naming its owner. A lock whose owner is gone but that a process it
        forked still holds (an flock belongs to every copy of the file descriptor) is waited for, up to
        :data:`INHERITED_LOCK_WAIT_S`: a killed logger or compaction leaves it held only that long."""
        deadline = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._owner(fd)
                os.close(fd)
                gone = _owner_gone(owner)
                if gone:
                    deadline = time.monotonic() + INHERITED_LOCK_WAIT_S if deadline is None else deadline
                    if time.monotonic() < deadline:
                        time.sleep(0.01)
                        continue
                raise LogDirError(f"run {run_id!r} rank {rank} is being written by another logger (pid "
                                  f"{owner.get('pid', '?')} on host {owner.get('hostname', '?')}, since "
                                  f"{owner.get('at', '?')}; lock {str(self.path)!r}); close it first, or log "
                                  f"another rank or run_id"
                                  + (f" (pid {owner['pid']} is gone, but a process it started has held its lock "
                                     f"for {INHERITED_LOCK_WAIT_S:g} s)" if gone else "")) from None
            except OSError as err:
                if err.errno not in NO_LOCKS:
                    os.close(fd)
                    raise
                warnings.warn(f"trustscope: {str(self.path)!r} cannot be locked on this file system ({err}); a "
                              f"second logger on run {run_id!r} rank {rank} will not be detected", LogWarning,
                              stacklevel=4)
                break
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its owner released and removed it while we waited for it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(), "at": now()}).encode())
        self._fd = fd

    @staticmethod
    def _owner(fd: int) -> dict:
        try:
            owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # a read-only directory keeps it: the next owner takes it over
                self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _owner_gone(owner: dict) -> bool:
    """Whether the lock owner a lock file names ran on this host and no process of its pid exists now."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid() or owner.get("hostname") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


class NoLock:
    """What an object store run has instead of :class:`RunLock`: S3 offers no lock, so a second logger on the
    same rank is not detected (a warning says so at open)."""

    def __init__(self, url: str):
        self.url = url

    def acquire(self, run_id: str, rank: int) -> None:
        warnings.warn(f"trustscope: object storage has no locks; a second logger on run {run_id!r} rank {rank} "
                      f"under {self.url} will not be detected", LogWarning, stacklevel=4)

    def release(self) -> None:
        pass
