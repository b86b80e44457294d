"""Where user SQL runs: a worker process whose DuckDB cannot write, outgrow its memory, or outlast its time.

User SQL (``trustscope sql``, :meth:`trustscope.db.LogDB.sql`, the dashboard's SQL console) goes through two
independent guards:

1. **A parse of the whole statement** (:func:`check_statement`). DuckDB's own parse tree
   (``json_serialize_sql``) is walked node by node: only a read is accepted (SELECT, FROM-first, DESCRIBE,
   SUMMARIZE, PIVOT, CTEs, subqueries; ``EXPLAIN [ANALYZE]`` of one of those), file-reading functions and file
   paths are refused with the reason, and so are the few functions that act instead of read.
2. **An engine that cannot write.** The worker opens the views and macros from a database file in
   ``read_only`` mode (no CREATE, DROP, ALTER, INSERT on the shared catalogue; temporary objects die with the
   query's own cursor), disables DuckDB's local file system altogether and reads the log directory through
   ``ReadOnlyLogFS`` (:func:`read_only_fs_class`), which opens files for reading only and only under the log
   directories: COPY ... TO, EXPORT, ATTACH, INSTALL have no file system to write to. External access is off and the configuration locked.

Limits: DuckDB's ``memory_limit`` inside the worker, and a watchdog in the calling process that reads the
worker's resident memory and the clock while it waits. At the time limit the worker interrupts its own
connection (``interrupt()``); a query that does not stop within :data:`KILL_GRACE_S` more, or whose worker grows
past the memory limit, is ended by killing the worker (a fresh one starts with the next query).

The worker imports only the standard library, DuckDB, pyarrow and fsspec: ``python -m trustscope.sandbox``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import glob as _glob
import json
import os
import re
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

PROTOCOL = "tslog"
"""The worker reads log files as ``tslog://<absolute path>``; DuckDB's local file system is off there."""
MEMORY_ENV = "TRUSTSCOPE_SQL_MEMORY"
"""Memory limit of user SQL: a fraction of physical memory (``0.25``) or bytes (``2e9``)."""
DEFAULT_MEMORY_FRACTION = 0.25
"""User SQL may use this fraction of the machine's physical memory unless told otherwise."""
DUCKDB_MEMORY_SHARE = 0.75
"""DuckDB's own ``memory_limit`` in the worker, as a share of the limit: its buffer-managed operators then fail
with DuckDB's out-of-memory error before the watchdog has to kill the worker."""
KILL_GRACE_S = 0.5
"""Seconds past the time limit a query may take to honour its interrupt before its worker is killed."""
START_TIMEOUT_S = 60.0
"""Seconds a new worker may take to open its database (not counted in any query's time)."""
POLL_S = 0.02
"""How often the watchdog reads the worker's resident memory while it waits."""

FILE_FUNCTIONS = frozenset({
    "read_parquet", "parquet_scan", "read_csv", "read_csv_auto", "read_json", "read_json_auto", "read_ndjson",
    "read_ndjson_auto", "read_json_objects", "read_json_objects_auto", "read_ndjson_objects", "read_text",
    "read_blob", "glob", "parquet_metadata", "parquet_schema", "parquet_file_metadata", "parquet_kv_metadata",
    "parquet_bloom_probe", "sniff_csv", "read_xlsx", "read_duckdb",
})
"""Table functions whose first argument names files."""
ACTING_FUNCTIONS = {
    "duckdb_extensions": "duckdb_extensions() lists the extension directory; extensions are locked for user SQL",
    "checkpoint": "checkpoint() writes the database",
    "force_checkpoint": "force_checkpoint() writes the database",
}
"""Functions that act rather than read, and why user SQL may not call them."""
READ_STATEMENT_START = frozenset({"select", "with", "from", "pivot", "unpivot", "values", "table", "describe",
                                  "summarize", "show", "("})
WRITE_KEYWORDS = frozenset({
    "alter", "analyze", "attach", "call", "checkpoint", "comment", "copy", "create", "deallocate", "delete",
    "detach", "drop", "execute", "explain", "export", "force", "import", "insert", "install", "load", "merge",
    "pragma", "prepare", "reset", "set", "truncate", "update", "use", "vacuum",
})
"""Keywords that make a statement more than a read (checked on the tokens of a PIVOT, which has no tree)."""


class QueryRefused(ValueError):
    """User SQL that the sandbox does not run; the message says what was refused and why."""


class QueryStopped(RuntimeError):
    """User SQL stopped at one of its limits."""


class QueryTimeout(QueryStopped):
    """User SQL stopped at its time limit."""


class QueryMemoryLimit(QueryStopped):
    """User SQL stopped at its memory limit."""


# ------------------------------------------------------------------------------------------- the parse check


def check_statement(query: str, readable: Sequence[Path] = ()) -> None:
    """Refuse ``query`` unless it is one read: raise :class:`QueryRefused` saying what was refused.

    ``readable`` are the log directories (resolved). Paths in the query are refused in any case (the log
    directory is read through the views); the message says whether the path lies outside the log directory.
    """
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as err:
        raise QueryRefused(f"refused: the query does not parse ({_first_line(err)})") from None
    if len(statements) != 1:
        raise QueryRefused(f"refused: expected exactly one statement, got {len(statements)}")
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN:
        check_statement(_explained(query), readable)
    elif kind == duckdb.StatementType.MULTI:
        _check_pivot_tokens(query, readable)
    elif kind == duckdb.StatementType.SELECT:
        _walk(_parse_tree(query), readable)
    else:
        name = str(kind).rsplit(".", 1)[-1]
        raise QueryRefused(f"refused: {name} statements are not allowed; user SQL is read-only (one SELECT)")


def _tokens(query: str) -> list[tuple[str, str]]:
    """(text, kind) of every token but comments, in order (DuckDB's own tokenizer)."""
    raw = duckdb.tokenize(query)
    out = []
    for i, (start, kind) in enumerate(raw):
        end = raw[i + 1][0] if i + 1 < len(raw) else len(query)
        if kind != duckdb.token_type.comment:
            out.append((query[start:end].strip(), str(kind).rsplit(".", 1)[-1]))
    return out


def _explained(query: str) -> str:
    """The statement an EXPLAIN wraps: the text after ``explain``, ``analyze`` and a ``(...)`` option list."""
    raw = [(start, kind) for start, kind in duckdb.tokenize(query) if kind != duckdb.token_type.comment]
    words = [_token_at(query, start) for start, _ in raw]
    i = 1  # raw[0] is EXPLAIN
    if i < len(words) and words[i].lower() == "analyze":
        i += 1
    if i < len(words) and words[i] == "(":
        depth = 0
        while i < len(words):
            depth += words[i] == "("
            depth -= words[i] == ")"
            i += 1
            if depth == 0:
                break
    if i >= len(raw):
        raise QueryRefused("refused: EXPLAIN of nothing")
    return query[raw[i][0]:]


def _token_at(query: str, start: int) -> str:
    match = re.match(r"\s*(\w+|'[^']*'|\"[^\"]*\"|\S)", query[start:])
    return match.group(1) if match else ""


_PARSER: list[duckdb.DuckDBPyConnection] = []
_PARSER_LOCK = threading.Lock()


def _parse_tree(query: str) -> dict[str, Any]:
    """DuckDB's parse tree of a SELECT, from an empty in-memory connection kept for this (nothing is run)."""
    with _PARSER_LOCK:
        if not _PARSER:
            _PARSER.append(duckdb.connect(config={"enable_external_access": False}))
        cur = _PARSER[0].cursor()
    try:
        tree = json.loads(cur.execute("select json_serialize_sql(?::varchar)", [query]).fetchone()[0])
    finally:
        cur.close()
    if tree.get("error"):
        raise QueryRefused(f"refused: the query does not parse ({tree.get('error_message')})")
    return tree


def _walk(node: Any, readable: Sequence[Path]) -> None:
    """Visit every node of a parse tree; refuse file reads and functions that act."""
    if isinstance(node, list):
        for child in node:
            _walk(child, readable)
        return
    if not isinstance(node, dict):
        return
    if node.get("class") == "FUNCTION":
        _check_function(node, readable)
    if node.get("type") == "BASE_TABLE" and _looks_like_path(node.get("table_name", "")):
        _refuse_path(node["table_name"], readable)
    for child in node.values():
        _walk(child, readable)


def _check_function(node: dict[str, Any], readable: Sequence[Path]) -> None:
    name = str(node.get("function_name", "")).lower()
    if name in ACTING_FUNCTIONS:
        raise QueryRefused(f"refused: {ACTING_FUNCTIONS[name]}")
    args = [a.get("expression", a) for a in node.get("arguments") or node.get("children") or []]
    if name in FILE_FUNCTIONS:
        paths = _constant_strings(args[0]) if args else []
        if paths is None or not paths:
            raise QueryRefused(f"refused: {name}() reads files, and user SQL reads the log directory through the "
                               "views (tokens, samples, steps, runs, vocab, ...)")
        for path in paths:
            _refuse_path(path, readable)
    if name in ("query", "query_table") and args:
        texts = _constant_strings(args[0])
        if texts is None:
            raise QueryRefused(f"refused: {name}() takes a constant in user SQL")
        for text in texts:
            if name == "query":
                check_statement(text, readable)
            elif _looks_like_path(text):
                _refuse_path(text, readable)


def _constant_strings(expr: dict[str, Any]) -> list[str] | None:
    """The strings of a constant or a list of constants; None when the expression is anything else."""
    if expr.get("class") == "CONSTANT":
        literal = expr.get("literal") or expr.get("value") or {}
        return [str(literal.get("text", literal.get("value", "")))]
    if expr.get("class") == "FUNCTION" and expr.get("function_name") == "list_value":
        out: list[str] = []
        for arg in expr.get("arguments") or expr.get("children") or []:
            strings = _constant_strings(arg.get("expression", arg))
            if strings is None:
                return None
            out += strings
        return out
    return None


def _looks_like_path(name: str) -> bool:
    return any(c in name for c in "/\\.:*")


def _inside(path: str, readable: Sequence[Path]) -> bool:
    if "://" in path or re.match(r"^[a-z0-9]+:", path):
        return False
    static = re.split(r"[*?\[{]", path, maxsplit=1)[0]
    if ".." in Path(path[len(static):]).parts:
        return False
    full = os.path.realpath(os.path.expanduser(static or "."))
    return any(full == str(r) or full.startswith(str(r).rstrip(os.sep) + os.sep) for r in readable)


def _refuse_path(path: str, readable: Sequence[Path]) -> None:
    if not _inside(path, readable):
        raise QueryRefused(f"refused: reads outside the log directory ({path!r})")
    raise QueryRefused(f"refused: {path!r} is read through the views here (tokens, samples, steps, runs, "
                       "vocab, ...), not by file path")


def _check_pivot_tokens(query: str, readable: Sequence[Path]) -> None:
    """A PIVOT whose values come from the data is several statements to DuckDB and has no parse tree: accept it
    when it starts as a read and no token makes it more than a read (keywords, path literals, acting or
    file-reading functions)."""
    tokens = _tokens(query)
    if not tokens or tokens[0][0].lower() not in READ_STATEMENT_START:
        raise QueryRefused("refused: only a read (SELECT, PIVOT, ...) is allowed; user SQL is read-only")
    for text, kind in tokens:
        word = text.lower()
        if kind == "keyword" and word in WRITE_KEYWORDS:
            raise QueryRefused(f"refused: {word.upper()} is not allowed; user SQL is read-only (one SELECT)")
        if kind == "identifier" and (word in ACTING_FUNCTIONS or word in FILE_FUNCTIONS
                                     or word in ("query", "query_table")):
            raise QueryRefused(f"refused: {word}() is not allowed in a PIVOT over values from the data; "
                               "give the values (PIVOT ... ON col IN (...)) or query the views")
        if kind == "string_const" and _looks_like_path(text.strip("'")):
            _refuse_path(text.strip("'"), readable)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]


# ------------------------------------------------------------------------------------------- the worker


class Forbidden(Exception):
    """A file operation the worker's file system refuses; not an OSError, so no caller takes it for "absent"."""


class _PositionalFile:
    """A read-only file whose position is kept per thread and read with ``os.pread``: DuckDB's threads share one
    handle and call ``seek`` then ``read``, which a shared position would let another thread's ``seek`` split."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self._where = threading.local()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.tell(), os.SEEK_END: self._size}[whence]
        self._where.pos = base + offset
        return self._where.pos

    def tell(self) -> int:
        return getattr(self._where, "pos", 0)

    def read(self, n: int = -1) -> bytes:
        pos = self.tell()
        data = os.pread(self._fd, self._size - pos if n is None or n < 0 else n, pos)
        self._where.pos = pos + len(data)
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> _PositionalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def read_only_fs_class() -> type:
    """:class:`ReadOnlyLogFS`, defined on first use: it is an fsspec file system, and only the worker needs one
    (the processes that hand it queries never import fsspec)."""
    import fsspec

    class ReadOnlyLogFS(fsspec.AbstractFileSystem):
        """``tslog://`` paths: the files under ``roots`` (resolved), opened for reading only; every write refused."""

        protocol = PROTOCOL
        root_marker = "/"
        cachable = False

        def __init__(self, roots: Iterable[str] = (), **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.roots = list(roots)

        @property
        def roots(self) -> list[str]:
            return self._roots

        @roots.setter
        def roots(self, roots: Iterable[str]) -> None:
            self._roots = [os.path.realpath(r) for r in roots]
            self._resolved: dict[str, str] = {}  # path -> its real path, under a root (DuckDB asks several times)

        def _local(self, path: str) -> str:
            """The real path of ``path`` (links followed); refused unless it lies under one of the roots."""
            if path in self._resolved:
                return self._resolved[path]
            real = os.path.realpath(self._strip_protocol(path) or "/")
            if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self._roots):
                raise Forbidden(f"refused: reads outside the log directory ({real})")
            self._resolved[path] = real
            return real

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            if mode != "rb":
                raise Forbidden(f"refused: user SQL cannot write ({self._strip_protocol(path)})")
            return _PositionalFile(self._local(path))  # DuckDB closes it

        def glob(self, path: str, **kwargs: Any) -> list[str]:
            pattern = self._strip_protocol(path)
            self._local(re.split(r"[*?\[{]", pattern, maxsplit=1)[0])  # refuse before searching
            return [p for p in sorted(_glob.glob(pattern)) if self._local(p)]

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
            local, name = self._local(path), self._strip_protocol(path)
            entries = [self.info(os.path.join(name, n)) for n in sorted(os.listdir(local))] \
                if os.path.isdir(local) else [self.info(name)]
            return entries if detail else [e["name"] for e in entries]

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            local = self._local(path)
            st = os.stat(local)
            name = self._strip_protocol(path)
            return {"name": name, "size": st.st_size, "type": "directory" if os.path.isdir(local) else "file"}

        def modified(self, path: str) -> _dt.datetime:
            return _dt.datetime.fromtimestamp(os.stat(self._local(path)).st_mtime, _dt.UTC)

        def _refuse(self, *args: Any, **kwargs: Any) -> None:
            raise Forbidden("refused: user SQL cannot write")

        mkdir = makedirs = rm = rm_file = rmdir = mv = cp_file = put_file = touch = pipe_file = _refuse

    return ReadOnlyLogFS


def _open_database(init: dict[str, Any]) -> tuple[duckdb.DuckDBPyConnection, Any]:
    """The worker's connection: the catalogue read-only, only ``tslog://`` readable, nothing writable."""
    con = duckdb.connect(init["database"], read_only=True, config={
        "autoload_known_extensions": False,
        "autoinstall_known_extensions": False,
        "allow_community_extensions": False,
        "allow_persistent_secrets": False,
        "memory_limit": f"{int(init['memory_bytes'] * DUCKDB_MEMORY_SHARE)}B",
        "temp_directory": "",
    })
    fs = read_only_fs_class()(init["roots"])
    con.register_filesystem(fs)
    con.execute("set allowed_directories = ?", [[f"{PROTOCOL}://"]])
    con.execute("set enable_external_access = false")
    con.execute("set disabled_filesystems = 'LocalFileSystem'")
    con.execute("set lock_configuration = true")
    return con, fs


def _run(con: duckdb.DuckDBPyConnection, fs: Any, request: dict[str, Any],
         caches: dict[str, tuple[int, pa.Table]]) -> pa.Table:
    fs.roots = request["roots"]
    cur = con.cursor()
    try:
        cur.execute("set variable trustscope_files = ?", [request["files"]])
        cur.execute("set variable trustscope_params = ?", [request["params"]])
        for name, (version, path) in request["caches"].items():
            if caches.get(name, (None,))[0] != version:
                with pa.memory_map(path) as source:
                    caches[name] = (version, pa.ipc.open_file(source).read_all())
            cur.register(name, caches[name][1])
        timer = threading.Timer(request["timeout_s"], cur.interrupt)
        timer.start()
        try:
            table = cur.sql(request["query"]).limit(request["max_rows"] + 1).to_arrow_table()
        finally:
            timer.cancel()
        return _local_paths(table)
    finally:
        cur.close()


def _local_paths(table: pa.Table) -> pa.Table:
    """File names in the result as the caller knows them (``source_file`` without the ``tslog://`` prefix)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            import pyarrow.compute as pc  # here: a result without text (a count) never pays its 60 ms import

            plain = pc.replace_substring_regex(table.column(i), f"^{PROTOCOL}://", "")
            table = table.set_column(i, field, plain)
    return table


def _read_frame(fd: int) -> bytes | None:
    head = _read_exact(fd, 8)
    return None if head is None else _read_exact(fd, struct.unpack("<Q", head)[0])


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_frame(fd: int, payload: bytes) -> None:
    data = struct.pack("<Q", len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def serve(inp: int, out: int) -> None:
    """The worker's loop: an init frame, then one request frame -> one header frame (+ Arrow IPC frame)."""
    read_only_fs_class()  # fsspec's import (about 50 ms) while the caller still opens its logs, not after
    init = json.loads(_read_frame(inp) or b"{}")
    con, fs = _open_database(init)
    _write_frame(out, json.dumps({"ok": True, "ready": True}).encode())
    caches: dict[str, tuple[int, pa.Table]] = {}
    while (frame := _read_frame(inp)) is not None:
        request = json.loads(frame)
        try:
            table = _run(con, fs, request, caches)
        except (duckdb.Error, Forbidden, OSError, pa.ArrowException) as err:
            kind = type(err).__name__
            _write_frame(out, json.dumps({"ok": False, "error": kind, "message": str(err)}).encode())
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        _write_frame(out, json.dumps({"ok": True}).encode())
        _write_frame(out, sink.getvalue().to_pybytes())


# ------------------------------------------------------------------------------------------- the caller's side


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes(limit: float | None = None) -> int:
    """``limit`` (else ``$TRUSTSCOPE_SQL_MEMORY``, else :data:`DEFAULT_MEMORY_FRACTION`) in bytes: a value up to
    1 is a fraction of physical memory, a larger one a number of bytes."""
    if limit is None:
        raw = os.environ.get(MEMORY_ENV)
        try:
            limit = float(raw) if raw else DEFAULT_MEMORY_FRACTION
        except ValueError:
            raise ValueError(f"${MEMORY_ENV}={raw!r} must be a fraction of memory (0.25) or bytes (2e9)") from None
    if not limit > 0:
        raise ValueError(f"memory_limit={limit!r} must be > 0 (a fraction of memory up to 1, or bytes)")
    return int(limit * physical_memory()) if limit <= 1 else int(limit)


def _rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes (0 where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _popen(cwd: Path | str) -> subprocess.Popen[bytes]:
    """A worker process, importing its modules; it waits for its set-up (the database, the limits) on stdin."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen([sys.executable, "-m", "trustscope.sandbox"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=cwd, env=env)


class _Forked:
    """A worker forked from this process (see :func:`prewarm`), with the few ``Popen`` members the caller uses."""

    def __init__(self, pid: int, stdin: int, stdout: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb", buffering=0)
        self.stdout = os.fdopen(stdout, "rb", buffering=0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)


def _fork_worker() -> _Forked:
    """A worker forked from this process before it opened any DuckDB connection: it has the worker's modules
    already (no new interpreter to start), and from here on it is the same worker as a spawned one: its own
    process and engine, the catalogue read-only, no local file system."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.close(requests_w)
            os.close(answers_r)
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
            serve(requests_r, answers_w)
        finally:
            os._exit(0)
    os.close(requests_r)
    os.close(answers_w)
    return _Forked(pid, requests_w, answers_r)


_spare: list[Any] = []


def prewarm(fork: bool = False) -> None:
    """Have a worker get ready for the next :class:`Sandbox` of this process while the caller opens its logs.

    ``fork``: forked from this process, which must be a one-shot command that has opened no DuckDB connection yet
    (so no engine thread or lock is copied; the console script's ``trustscope sql``): that skips a new
    interpreter's start-up and imports, a few hundred ms. Otherwise spawned, as every worker of a long-lived
    process is. A worker that is never used ends with this process (its pipe closes)."""
    if not any(p.poll() is None for p in _spare):
        _spare.append(_fork_worker() if fork else _popen(tempfile.gettempdir()))


def _take_spare() -> Any:
    while _spare:
        proc = _spare.pop()
        if proc.poll() is None:
            return proc
    return None


class Sandbox:
    """One worker process for one :class:`trustscope.db.LogDB`, started on the first query; queries take turns.

    ``database`` is the read-only catalogue (views and macros) built by the caller; ``memory_bytes`` bounds the
    worker's resident memory. ``peak_rss`` is the most the watchdog saw the worker hold during the last query.
    """

    def __init__(self, database: Path, memory_bytes: int) -> None:
        self.database = database
        self.memory_bytes = memory_bytes
        self.peak_rss = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the worker now, without waiting for it, so that it gets ready while the caller works; the first
        query waits for it (a no-op when one is running)."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc, self._ready = self._spawn(), False

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = _take_spare() or _popen(self.database.parent)
        _write_frame(proc.stdin.fileno(), json.dumps({
            "database": str(self.database), "roots": [], "memory_bytes": self.memory_bytes}).encode())
        return proc

    def _await_ready(self, proc: subprocess.Popen[bytes]) -> None:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        if not ready or _read_frame(proc.stdout.fileno()) is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the SQL worker did not start within {START_TIMEOUT_S:g} s (its error is on stderr)")
        self._ready = True

    def run(self, query: str, *, roots: Sequence[Path], files: dict[str, list[str]], params: dict[str, Any],
            caches: dict[str, tuple[int, str]], max_rows: int, timeout_s: float) -> pa.Table:
        """Rows of ``query`` (at most ``max_rows + 1``); raises :class:`QueryTimeout`, :class:`QueryMemoryLimit`,
        :class:`QueryRefused` for a permission error, or DuckDB's own error class for a bad query."""
        with self._lock:
            request = json.dumps({"query": query, "roots": [str(r) for r in roots], "files": _in_protocol(files),
                                  "params": params, "caches": caches, "max_rows": max_rows,
                                  "timeout_s": timeout_s}).encode()
            proc = self._send(request)
            header = self._wait(proc, timeout_s)
            if not header["ok"]:
                raise _error(header)
            body = _read_frame(proc.stdout.fileno())
            if body is None:
                self.close()
                raise RuntimeError("the SQL worker stopped while sending its result")
            return pa.ipc.open_stream(body).read_all()

    def _send(self, request: bytes) -> subprocess.Popen[bytes]:
        """Hand ``request`` to the worker, starting one when there is none (or it died since the last query)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                if not self._ready:
                    self._await_ready(self._proc)
                _write_frame(self._proc.stdin.fileno(), request)
                return self._proc
            except BrokenPipeError:
                self.close()
        self.start()
        self._await_ready(self._proc)
        _write_frame(self._proc.stdin.fileno(), request)
        return self._proc

    def _wait(self, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
        """The worker's answer; kill it at the time limit (plus grace) or the memory limit."""
        start = time.monotonic()
        self.peak_rss = 0
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if ready:
                frame = _read_frame(fd)
                if frame is None:
                    code = proc.wait()
                    self.close()
                    if code == -9:  # the kernel's out-of-memory killer
                        raise QueryMemoryLimit("query stopped: the system ran out of memory; narrow it down")
                    raise RuntimeError(f"the SQL worker exited with status {code} (its error is on stderr)")
                return json.loads(frame)
            rss = _rss(proc.pid)
            self.peak_rss = max(self.peak_rss, rss)
            elapsed = time.monotonic() - start
            if rss > self.memory_bytes:
                self.close()
                raise QueryMemoryLimit(f"query stopped at the memory limit of {_size(self.memory_bytes)} "
                                       f"(after {elapsed:.1f} s); narrow it down or raise {MEMORY_ENV}")
            if elapsed > timeout_s + KILL_GRACE_S:
                self.close()
                raise QueryTimeout(f"query stopped at the time limit of {timeout_s:g} s")

    def close(self) -> None:
        """End the worker (a later query starts another)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()


def _in_protocol(files: dict[str, list[str]]) -> dict[str, list[str]]:
    return {table: [f"{PROTOCOL}://{p}" for p in paths] for table, paths in files.items()}


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _error(header: dict[str, Any]) -> Exception:
    kind, message = header["error"], header["message"]
    if kind == "InterruptException":
        return QueryTimeout(f"query stopped at the time limit ({_first_line(Exception(message))})")
    if kind == "OutOfMemoryException":
        return QueryMemoryLimit(f"query stopped at the memory limit: {_first_line(Exception(message))}")
    if kind in ("PermissionException", "PermissionError") or "refused:" in message:
        reason = message.split("refused: ", 1)[1].splitlines()[0] if "refused: " in message else message
        if "LocalFileSystem" in message or "outside" in reason:
            reason = "reads outside the log directory"
        return QueryRefused(f"refused: {reason}")
    cls = getattr(duckdb, kind, None)
    if isinstance(cls, type) and issubclass(cls, duckdb.Error):
        return cls(message)
    return duckdb.Error(f"{kind}: {message}")


if __name__ == "__main__":
    out_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
    serve(sys.stdin.fileno(), out_fd)
