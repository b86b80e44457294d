"""Local file primitives the format's commits rest on: fsync, replace by rename, and the atomic exchange of two folders
(``renameat2(RENAME_EXCHANGE)``) that a compaction's folder swap uses.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

from trustscope.runformat.layout import TMP_SUFFIX


def fsync_file(path: str | os.PathLike) -> None:
    """Put the local file ``path``'s bytes on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: str | os.PathLike, final: str | os.PathLike, fsync: bool) -> None:
    """Rename the finished local file ``tmp`` to ``final`` atomically, its bytes on disk first when ``fsync``."""
    if fsync:
        fsync_file(tmp)
    os.replace(tmp, final)


RENAME_EXCHANGE = 2
"""``renameat2``'s flag that swaps two existing paths in one atomic step (Linux 3.15; ext4, xfs, btrfs, tmpfs)."""


_AT_FDCWD = -100


_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV}


_exchange_ok: dict[int, bool] = {}


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, looked up once, from the symbols the process has loaded already. Never through
    ``ctypes.util.find_library``: it runs ``ldconfig -p`` in a child process, which holds a copy of every open
    file (a rank's lock among them) until it execs, so a process killed in that moment leaves its lock held by
    a process that is not itself, for a while after it is gone; and it costs milliseconds a swap."""
    import ctypes

    for name in (None, "libc.so.6"):
        try:
            fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap the two existing paths ``a`` and ``b`` (folders here) in one atomic step: a reader resolving either
    name finds the old entry or the new one, never neither (Linux ``renameat2(RENAME_EXCHANGE)`` through libc).
    Raises OSError (EINVAL, ENOSYS, ...) where the system or file system cannot (see :func:`can_exchange`)."""
    import ctypes

    fn = _renameat2() if sys.platform.startswith("linux") else None
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2(RENAME_EXCHANGE) is not available on this system")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def can_exchange(folder: str | os.PathLike) -> bool:
    """Whether :func:`exchange` works inside ``folder`` (tried once per file system on two empty folders made
    there; NFS and non-Linux systems cannot)."""
    folder = Path(folder)
    try:
        dev = folder.stat().st_dev
    except OSError:
        return False
    if dev not in _exchange_ok:
        probe = folder / f".exchange-{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            (probe / "a").mkdir(parents=True)
            (probe / "b").mkdir()
            exchange(probe / "a", probe / "b")
            _exchange_ok[dev] = True
        except OSError as err:
            if err.errno not in _NO_EXCHANGE:
                return False  # the folder cannot be written: nothing to swap here (the file system is not judged)
            _exchange_ok[dev] = False
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    return _exchange_ok[dev]
