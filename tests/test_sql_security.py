"""User SQL is read-only, reads only the log directory, and is limited in rows and time."""

from __future__ import annotations

import pytest

from trustscope import db as tsdb
from trustscope.synthetic import SyntheticConfig, generate_run


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox")
    logdir = root / "logs"
    generate_run(logdir, "run0", SyntheticConfig(tokens=3_000, steps=2, edge_cases=False))
    (root / "secret.csv").write_text("password\nhunter2\n")
    conn = tsdb.connect(logdir, cache_dir=root / "cache", max_rows=100, timeout_s=2.0)
    conn.secret = root / "secret.csv"
    conn.outside = root
    yield conn
    conn.close()


def test_plain_select_works_and_rows_are_capped(db):
    res = db.sql("select step, count(*) as n from tokens group by step order by step")
    assert res.table.column("n").to_pylist()[0] > 0 and not res.truncated
    big = db.sql("select * from range(1000)")
    assert big.table.num_rows == 100 and big.truncated
    assert db.sql("select 1 as x", max_rows=1).truncated is False


@pytest.mark.parametrize(
    "query",
    [
        "select * from read_text('/etc/passwd')",
        "select * from read_csv('/etc/passwd', sep = ':')",
        "select * from read_csv('{secret}')",
        "select * from read_parquet('{logdir}/../secret.csv')",
        "select * from glob('/etc/*')",
        "select * from read_text('{logdir}/../../etc/passwd')",
        "select * from read_json('http://example.com/data.json')",
        "select * from read_parquet('s3://bucket/x.parquet')",
        "select * from query('select * from read_text(''/etc/passwd'')')",
    ],
)
def test_reading_outside_the_log_directory_is_refused(db, query):
    q = query.format(secret=db.secret, logdir=db.paths[0])
    with pytest.raises((tsdb.QueryRefused, Exception)) as err:
        db.sql(q)
    msg = str(err.value).lower()
    assert "hunter2" not in msg and "root:" not in msg
    assert any(w in msg for w in ("refused", "permission", "disabled", "not allowed", "extension")), msg


@pytest.mark.parametrize(
    ("query", "kind"),
    [
        ("copy (select 1) to '{logdir}/out.csv'", "COPY"),
        ("copy tokens to '/tmp/stolen.parquet'", "COPY"),
        ("attach '/tmp/other.duckdb' as other", "ATTACH"),
        ("install httpfs", "LOAD"),
        ("load httpfs", "LOAD"),
        ("export database '/tmp/dump'", "EXPORT"),
        ("set enable_external_access = true", "SET"),
        ("set lock_configuration = false", "SET"),
        ("reset allowed_directories", "SET"),
        ("pragma enable_profiling", "PRAGMA"),
        ("call pragma_version()", "CALL"),
        ("create table t as select 1", "CREATE"),
        ("insert into t values (1)", "INSERT"),
        ("drop view tokens", "DROP"),
        ("set variable trustscope_files = 1", "SET"),
        ("select 1; select 2", "exactly one statement"),
    ],
)
def test_statements_other_than_select_are_refused(db, query, kind):
    with pytest.raises(tsdb.QueryRefused) as err:
        db.sql(query.format(logdir=db.paths[0]))
    assert kind in str(err.value)
    assert not (db.paths[0] / "out.csv").exists()


def test_configuration_is_locked_and_external_access_off(db):
    cur = db.cursor()
    try:
        row = cur.sql(
            "select current_setting('enable_external_access'), current_setting('lock_configuration'), "
            "current_setting('autoload_known_extensions'), current_setting('autoinstall_known_extensions')"
        ).fetchall()[0]
        assert row == (False, True, False, False)
        with pytest.raises(Exception, match="locked"):
            cur.execute("set enable_external_access = true")
    finally:
        cur.close()


def test_a_long_query_is_interrupted(db):
    with pytest.raises(tsdb.QueryTimeout, match="time limit"):
        db.sql("select count(*) from range(100000000000) a", timeout_s=0.5)
    assert db.sql("select 42 as x").table.column("x").to_pylist() == [42]
