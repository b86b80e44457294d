"""User SQL is read-only at the root, reads only the log directory, and stops at its row, time and memory limits.

Two guards are tested apart: the parse check (every escape is refused with a refusal's wording) and the engine
that runs user SQL (the same escapes sent past the check write nothing and change nothing other queries see).
"""

from __future__ import annotations

import os
import time

import pytest

from trustscope import db as tsdb
from trustscope.sandbox import KILL_GRACE_S
from trustscope.synthetic import SyntheticConfig, generate_run


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox")
    logdir = root / "logs"
    generate_run(logdir, "run0", SyntheticConfig(tokens=3_000, steps=2, edge_cases=False))
    (root / "secret.csv").write_text("password\nhunter2\n")
    conn = tsdb.connect(logdir, cache_dir=root / "cache", max_rows=100, timeout_s=10.0)
    conn.secret = root / "secret.csv"
    yield conn
    conn.close()


def _files(root):
    """Every file under ``root`` with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def _fmt(query, db):
    logdir = db.paths[0]
    return query.format(logdir=logdir, run=logdir / "run0", secret=db.secret)


@pytest.fixture
def unchanged(db):
    """Asserts, after the test, that no file of the log directory changed and every later query sees the views
    as before."""
    before = _files(db.paths[0])
    counts = db.sql("select (select count(*) from tokens) as t, (select count(*) from step_summary) as s").table
    yield
    assert _files(db.paths[0]) == before
    assert db.sql("select (select count(*) from tokens) as t, "
                  "(select count(*) from step_summary) as s").table.equals(counts)
    assert db.runs().status.tolist() == ["finished"]


ESCAPES = [
    # the escapes: EXPLAIN ANALYZE executes what it wraps
    "explain analyze copy (select 1 as a) to '{logdir}/x.csv'",
    "explain analyze copy (select 1 as a) to '{run}/run.json' (format csv, header false)",
    "explain analyze copy (select * from tokens limit 1) to '{run}/tokens/forged.parquet' (format parquet)",
    "explain analyze create or replace view step_summary as select 1 as x",
    "explain analyze drop view tokens",
    # the same in comments, option lists, CTEs, subqueries and PIVOT
    "/* a note */ explain /* more */ analyze -- and more\n copy (select 1 as a) to '{logdir}/x.csv'",
    "explain (analyze, format json) copy (select 1 as a) to '{logdir}/x.csv'",
    "explain analyze copy (with t as (select 1 as a) select * from t) to '{logdir}/x.csv'",
    "explain analyze copy (select * from (select 1 as a) as s) to '{run}/run.json' (format csv, header false)",
    "explain analyze copy (pivot (select 1 as a, 'k' as b) on b using sum(a)) to '{logdir}/x.csv'",
    "copy (pivot (select 1 as a, 'k' as b) on b using sum(a)) to '{logdir}/x.csv'",
    "explain analyze explain analyze drop view tokens",
    "select * from query('copy (select 1) to ''{logdir}/x.csv''')",
    "with t as (select * from query('drop view tokens')) select * from t",
    # statements other than a read
    "copy (select 1) to '{logdir}/out.csv'",
    "copy tokens to '/tmp/stolen.parquet'",
    "attach '{logdir}/other.duckdb' as other",
    "install httpfs",
    "load httpfs",
    "export database '{logdir}/dump'",
    "set enable_external_access = true",
    "set lock_configuration = false",
    "set memory_limit = '100GB'",
    "reset allowed_directories",
    "pragma enable_profiling",
    "call pragma_version()",
    "create table t as select 1",
    "create temp view step_summary as select 1 as x",
    "insert into t values (1)",
    "drop view tokens",
    "set variable trustscope_files = 1",
    "select 1; select 2",
]


@pytest.mark.parametrize("query", ESCAPES)
def test_escapes_are_refused_by_the_check(db, unchanged, query):
    with pytest.raises(tsdb.QueryRefused, match=r"^refused: "):
        db.sql(_fmt(query, db))


ROOT_ESCAPES = [
    "copy (select 1 as a) to '{logdir}/x.csv'",
    "copy (select 1 as a) to 'tslog://{logdir}/x.csv'",
    "copy (select 1 as a) to '{run}/run.json' (format csv, header false)",
    "copy (select * from tokens limit 1) to 'tslog://{run}/tokens/forged.parquet' (format parquet)",
    "explain analyze copy (select 1 as a) to 'tslog://{logdir}/x.csv'",
    "export database 'tslog://{logdir}/dump'",
    "create or replace view step_summary as select 1 as x",
    "drop view tokens",
    "alter view tokens rename to gone",
    "create table t as select 1",
    "attach 'tslog://{logdir}/other.duckdb' as other",
    "attach ':memory:' as other",
    "install httpfs",
    "load httpfs",
    "set enable_external_access = true",
    "set disabled_filesystems = ''",
    "set memory_limit = '100GB'",
    "select * from read_text('/etc/passwd')",
    "select * from read_text('tslog:///etc/passwd')",
    "select * from read_csv('tslog://{secret}')",
    "select * from read_text('tslog://{logdir}/../secret.csv')",
    "select * from read_json('http://example.com/data.json')",
]


@pytest.mark.parametrize("query", ROOT_ESCAPES)
def test_the_engine_itself_cannot_write_or_read_elsewhere(db, unchanged, query):
    """Sent past the parse check, straight to the worker: still nothing written, nothing outside read."""
    with pytest.raises(Exception) as err:
        db._run_in_sandbox(_fmt(query, db), 100, 10.0)
    msg = str(err.value)
    assert "hunter2" not in msg and "root:" not in msg
    assert not (db.paths[0] / "x.csv").exists()


def test_temporary_objects_die_with_their_query(db, unchanged):
    """A temporary view (the only catalog change the engine allows) shadows nothing in the next query."""
    db._run_in_sandbox("create temp view step_summary as select 1 as x", 100, 10.0)
    db._run_in_sandbox("create temp table scratch as select 1 as x", 100, 10.0)
    assert "n_tokens" in db.sql("select * from step_summary").table.column_names
    with pytest.raises(Exception, match="scratch"):
        db._run_in_sandbox("select * from scratch", 100, 10.0)


@pytest.mark.parametrize(
    ("query", "wording"),
    [
        ("from '/etc/passwd'", "reads outside the log directory"),
        ("select * from '/etc/passwd'", "reads outside the log directory"),
        ("select * from read_text('/etc/passwd')", "reads outside the log directory"),
        ("select * from read_csv('/etc/passwd', sep = ':')", "reads outside the log directory"),
        ("select * from read_csv('{secret}')", "reads outside the log directory"),
        ("select * from read_parquet('{logdir}/../secret.csv')", "reads outside the log directory"),
        ("select * from read_text('{logdir}/*/../../secret.csv')", "reads outside the log directory"),
        ("select * from glob('/etc/*')", "reads outside the log directory"),
        ("select * from read_json('http://example.com/data.json')", "reads outside the log directory"),
        ("select * from read_parquet('s3://bucket/x.parquet')", "reads outside the log directory"),
        ("select * from query('select * from read_text(''/etc/passwd'')')", "reads outside the log directory"),
        ("with p as (select * from read_text('/etc/passwd')) select * from p", "reads outside the log directory"),
        ("select (select content from read_text('/etc/passwd'))", "reads outside the log directory"),
        ("select * from tokens where source_file in (select file from glob('/etc/*'))",
         "reads outside the log directory"),
        ("explain analyze select * from read_text('/etc/passwd')", "reads outside the log directory"),
        ("select * from (pivot (select * from read_text('/etc/passwd')) on size using count(*))",
         "not allowed in a PIVOT"),
        ("select * from read_parquet('{run}/tokens/*.parquet')", "read through the views"),
        ("select * from read_text(getvariable('x'))", "reads files"),
        ("select * from duckdb_extensions()", "duckdb_extensions() lists the extension directory"),
    ],
)
def test_reads_outside_are_refused_as_refusals(db, unchanged, query, wording):
    with pytest.raises(tsdb.QueryRefused) as err:
        db.sql(_fmt(query, db))
    msg = str(err.value)
    assert msg.startswith("refused: ") and wording in msg, msg
    assert "hunter2" not in msg and "root:" not in msg


@pytest.mark.parametrize(
    "query",
    [
        "pivot (select run_id, step from steps) on run_id using count(*)",
        "select * from (pivot (select run_id, step from steps) on run_id using count(*))",
        "with p as (pivot (select run_id, step from steps) on run_id using count(*)) select * from p",
        "-- a note\npivot steps on name using avg(value) group by step",
        "pivot (select run_id, step from steps) on run_id in ('run0') using count(*)",
        "explain select * from tokens",
        "explain analyze select count(*) from tokens",
        "with t as (select step from tokens) select count(*) as n from t /* done */",
        "describe tokens",
        "summarize select step from steps",
        "from step_summary select step",
    ],
)
def test_reads_are_accepted(db, unchanged, query):
    assert db.sql(query).table.num_rows > 0


def test_plain_select_works_and_rows_are_capped(db):
    res = db.sql("select step, count(*) as n from tokens group by step order by step")
    assert res.table.column("n").to_pylist()[0] > 0 and not res.truncated
    big = db.sql("select * from range(1000)")
    assert big.table.num_rows == 100 and big.truncated
    assert db.sql("select 1 as x", max_rows=1).truncated is False
    files = db.sql("select distinct source_file from tokens").table.column("source_file").to_pylist()
    assert files and all(f.startswith(str(db.paths[0])) for f in files)


def test_configuration_is_locked_and_external_access_off(db):
    row = db._run_in_sandbox(
        "select current_setting('enable_external_access') as a, current_setting('lock_configuration') as b, "
        "current_setting('autoload_known_extensions') as c, current_setting('autoinstall_known_extensions') as d, "
        "current_setting('access_mode') as f", 10, 10.0
    ).table.to_pylist()[0]
    assert row == {"a": False, "b": True, "c": False, "d": False, "f": "read_only"}
    cur = db.cursor()  # the connection of the named analyses is locked too
    try:
        with pytest.raises(Exception, match="locked"):
            cur.execute("set enable_external_access = true")
    finally:
        cur.close()


def _stops_near(db, query, timeout_s):
    start = time.monotonic()
    with pytest.raises(tsdb.QueryStopped) as err:
        db.sql(query, timeout_s=timeout_s)
    wall = time.monotonic() - start
    return err.value, wall, db._resources.sandbox.peak_rss


@pytest.mark.slow
@pytest.mark.parametrize(
    ("query", "timeout_s"),
    [
        ("select length(repeat('x', 1000000000))", 2.0),
        ("select count(*) from (select unnest(range(100000000)) x)", 1.0),
        ("select count(*) from range(100000000000) a", 1.0),
    ],
)
def test_the_time_limit_stops_every_query(db, query, timeout_s):
    db.sql("select 1")  # a warm worker: its start is not the query's time
    err, wall, rss = _stops_near(db, query, timeout_s)
    assert isinstance(err, tsdb.QueryTimeout) and "time limit" in str(err)
    assert wall < timeout_s + KILL_GRACE_S + 1.0, wall
    assert rss < db.memory_bytes
    assert db.sql("select 42 as x").table.column("x").to_pylist() == [42]


@pytest.mark.slow
@pytest.mark.parametrize(
    "query",
    [
        "select length(repeat('x', 1000000000))",
        "select count(*) from (select unnest(range(100000000)) x)",
        "select max(length(s)) from (select repeat('ab', 100000) || i::varchar as s from range(20000) t(i)) "
        "group by s order by 1",
    ],
)
def test_the_memory_limit_holds(tmp_path, query):
    generate_run(tmp_path, "run0", SyntheticConfig(tokens=1_000, steps=1, edge_cases=False))
    limit = 400e6
    with tsdb.connect(tmp_path, cache_dir=tmp_path / "cache", memory_limit=limit, timeout_s=60.0) as small:
        small.sql("select 1")
        err, wall, rss = _stops_near(small, query, 60.0)
        assert isinstance(err, tsdb.QueryMemoryLimit) and "memory limit" in str(err)
        assert rss < limit * 1.25, rss  # the watchdog reads the worker's memory every few milliseconds
        assert wall < 30
        assert small.sql("select 42 as x").table.column("x").to_pylist() == [42]


def test_memory_limit_is_a_fraction_or_bytes(monkeypatch):
    from trustscope.sandbox import MEMORY_ENV, memory_limit_bytes, physical_memory

    assert memory_limit_bytes(0.5) == int(0.5 * physical_memory())
    assert memory_limit_bytes(2e9) == 2_000_000_000
    monkeypatch.setenv(MEMORY_ENV, "0.1")
    assert memory_limit_bytes() == int(0.1 * physical_memory())
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=MEMORY_ENV):
        memory_limit_bytes()
    with pytest.raises(ValueError, match="memory_limit"):
        memory_limit_bytes(-1)


def test_the_worker_reads_what_the_analyses_read(tmp_path):
    """Many files read by DuckDB's threads through the worker's file system: the same numbers as the analyses'
    own connection, every time (a shared file position once let one thread's seek corrupt another's read)."""
    generate_run(tmp_path, "run0", SyntheticConfig(tokens=20_000, steps=4, rows_per_file=500, edge_cases=False))
    query = ("select step, count(*) as n, sum(mu_logprob) as mu, max(source_file) as f from tokens "
             "group by step order by step")
    with tsdb.connect(tmp_path, cache=False) as conn:
        cur = conn.cursor()
        try:
            expected = cur.sql(query).to_arrow_table()
        finally:
            cur.close()
        for _ in range(5):
            got = conn.sql(query).table
            for column in ("step", "n", "f"):
                assert got.column(column).to_pylist() == expected.column(column).to_pylist()
            assert got.column("mu").to_pylist() == pytest.approx(expected.column("mu").to_pylist(), rel=1e-9)


def test_the_console_script_forks_its_worker_and_keeps_every_guard(tmp_path):
    """``trustscope sql`` as a user runs it (the console script, whose one-shot process forks the SQL worker
    before opening any connection): it answers, and the parse check, the engine that cannot write and the time
    limit hold as they do for a spawned worker."""
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    script = Path(sys.executable).parent / "trustscope"
    logs = Path(__file__).resolve().parent.parent / "sample_logs"
    env = {**os.environ, "TRUSTSCOPE_CACHE": str(tmp_path / "cache")}

    def sql(query: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(script), "sql", str(logs), query, "--format", "csv", *extra],
                              capture_output=True, text=True, env=env, timeout=120)

    logged = set()  # (run_id, step) of every steps file, read with pyarrow alone
    for path in logs.glob("*/steps/**/*.parquet"):
        table = pq.read_table(path, columns=["run_id", "step"])
        logged |= set(zip(table["run_id"].to_pylist(), table["step"].to_pylist(), strict=True))
    assert logged
    ok = sql("select count(distinct (run_id, step)) as n from steps")
    assert ok.returncode == 0 and ok.stdout.splitlines() == ['"n"', str(len(logged))], ok.stderr
    refused = sql(f"select * from read_text('{tmp_path}')")
    assert refused.returncode == 1 and "refused" in refused.stderr
    target = tmp_path / "escaped.parquet"
    written = sql(f"select * from (select 1) t, (copy (select 1) to '{target}')")
    assert written.returncode == 1 and not target.exists()
    slow = sql("select count(*) from range(100000000000) a", "--timeout", "1")
    assert slow.returncode == 1 and "time limit" in slow.stderr, slow.stderr
