"""Logs on object storage: the real TokenLogger writes to ``s3://`` and every reader reads it back, against a local
S3 endpoint (moto in server mode on 127.0.0.1), with the commit protocol kept: no reader sees half a flush."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from trustscope import runformat
from trustscope import runformat as S
from trustscope.cli import app
from trustscope.db import connect
from trustscope.logger import LogDirError, LogWarning, TokenLogger

pytestmark = pytest.mark.filterwarnings("ignore:trustscope. object storage has no locks:UserWarning")

B, T = 4, 6
BUCKET = "trustscope-test"

def only_rows_lost(result) -> bool:
    """``trustscope validate`` of a run that lost a flush: exit 1 and its one finding the ``rows_lost`` incident
    (the rows lost are named, the rest of the run reads whole)."""
    problems = [line for line in result.output.splitlines() if line.strip() and "problem(s) in" not in line]
    return result.exit_code == 1 and len(problems) == 1 and "logging incident rows_lost" in problems[0]



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on a free local port with one bucket; AWS_* variables point every client at it.

    The server runs in its own process: moto's server imports Flask, and a Flask proxy object in this process's
    modules breaks vLLM's engine start-up in later tests (its kernel registry probes every module's attributes)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()",
                               "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the moto server on port {port} did not start (exit {server.poll()})") from None
            time.sleep(0.2)
    url = f"http://127.0.0.1:{port}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("AWS_ENDPOINT_URL", url)
            runformat.s3_filesystem().mkdir(BUCKET)
            yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Mirrors and kept aggregates go to the test's own folder."""
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))


def step_data(step: int, rank: int = 0) -> dict:
    rng = np.random.default_rng(step)
    mu = -rng.random((B, T)).astype(np.float32) * 3
    pi = mu + rng.normal(0, 0.3, (B, T)).astype(np.float32)
    tokens = {"token_id": rng.integers(0, 10, (B, T)), "mu_logprob": mu, "pi_logprob": np.minimum(pi, 0),
              "advantage": rng.normal(size=B)}
    return {"tokens": tokens, "mask": np.ones((B, T), bool),
            "samples": {"sample_id": rank * B + np.arange(B), "prompt_id": np.zeros(B, int), "reward": rng.random(B)},
            "scalars": {"loss": float(step)}}


def log_run(logdir, run_id: str, steps, **kwargs) -> dict:
    """Log ``steps``, one flush each; returns the rank's manifest."""
    with TokenLogger(logdir, run_id, vocab=[str(i) for i in range(10)], flush_seconds=3600, **kwargs) as lg:
        for step in steps:
            lg.log_step(step, **step_data(step, lg.rank))
            lg.flush()
    return lg.manifest


def objects(prefix: str) -> list[str]:
    return sorted(runformat.s3_filesystem().find(prefix))


@pytest.mark.slow
def test_a_run_logged_to_s3_reads_as_the_same_run_logged_to_disk(endpoint, tmp_path):
    url = f"s3://{BUCKET}/same"
    manifest = log_run(url, "r1", range(3), storage_options={"endpoint_url": endpoint})
    log_run(tmp_path / "local", "r1", range(3))
    assert manifest["committed_flush"] == 3 and manifest["rows"]["tokens"] == 3 * B * T
    names = [o.rsplit("/", 2)[-2:] for o in objects(f"{BUCKET}/same/r1")]
    assert ["r1", "run.json"] in names and ["r1", "vocab.parquet"] in names
    assert not [n for n in names if n[-1].endswith(S.TMP_SUFFIX)], "no temporary object is left behind"

    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as remote, \
            connect(tmp_path / "local", cache=False) as local:
        pd.testing.assert_frame_equal(remote.step_summary(), local.step_summary())
        count = "select count(*) as n, count(distinct step) as steps from tokens"
        assert remote.sql(count).to_pandas().equals(local.sql(count).to_pandas())
        assert remote.sql(count).table.column("n")[0].as_py() == 3 * B * T
        runs = remote.runs()
        assert runs["run_id"].tolist() == ["r1"] and runs["status"].tolist() == ["finished"]


def test_two_ranks_on_s3_read_as_one_run(endpoint, tmp_path):
    url = f"s3://{BUCKET}/ranks"
    for rank in (0, 1):
        log_run(url, "r1", range(2), rank=rank)
    assert f"{BUCKET}/ranks/r1/ranks/rank0001.json" in objects(f"{BUCKET}/ranks/r1/ranks")
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        cur = db.cursor()
        try:
            assert cur.execute("select rank, count(*) from tokens group by rank order by rank").fetchall() == [
                (0, 2 * B * T), (1, 2 * B * T)]
        finally:
            cur.close()
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 0, result.output


def test_validate_and_report_read_s3(endpoint):
    url = f"s3://{BUCKET}/cli"
    log_run(url, "r1", range(2))  # the endpoint from AWS_ENDPOINT_URL
    runner = CliRunner()
    result = runner.invoke(app, ["validate", url])
    assert result.exit_code == 0, result.output
    assert f"ok: 1 run(s) in {url}" in result.output
    result = runner.invoke(app, ["report", url])
    assert result.exit_code == 0, result.output
    assert "r1" in result.output


@pytest.mark.slow
def test_the_dashboard_reads_s3(endpoint, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from app.launch import LOGDIR_ENV, MAIN

    url = f"s3://{BUCKET}/dashboard"
    log_run(url, "r1", range(2))
    monkeypatch.setenv(LOGDIR_ENV, url)
    at = AppTest.from_file(str(MAIN), default_timeout=120)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert f"`{url}`" in at.sidebar.caption[0].value
    assert "r1" in str([t.value for t in at.get("markdown")] + [str(d.value) for d in at.dataframe])


@pytest.mark.slow
def test_a_flush_cut_off_mid_upload_stays_invisible_until_its_parts_are_gone(endpoint, tmp_path, monkeypatch):
    """The store fails after a flush uploaded its tokens object and before the rest (and the delete of what was
    uploaded fails too): that object would turn visible with the next commit, so no commit happens until it is
    deleted. Then the run reads as if the failed flush had never been written."""
    url = f"s3://{BUCKET}/cutoff"
    publish, delete = runformat.ObjectStore.publish, runformat.ObjectStore.delete
    down = {"publish": False, "delete": False}

    def flaky_publish(self, tmp, final, fsync):
        if down["publish"] and S.table_of(final) != "tokens":
            raise runformat.StorageError(f"cannot upload {self.url_of(final)}: connection reset")
        publish(self, tmp, final, fsync)

    def flaky_delete(self, path):
        if down["delete"]:
            raise runformat.StorageError(f"cannot delete {self.url_of(path)}: connection reset")
        delete(self, path)

    monkeypatch.setattr(runformat.ObjectStore, "publish", flaky_publish)
    monkeypatch.setattr(runformat.ObjectStore, "delete", flaky_delete)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogWarning)
        lg = TokenLogger(url, "r1", strict=False, flush_seconds=3600)
        for step in range(5):
            down["publish"], down["delete"] = step == 2, step in (2, 3)
            lg.log_step(step, **step_data(step))
            lg.flush()
            if step == 3:  # flush 3 is not committed (nor uploaded) while step 2's tokens object remains
                assert lg.manifest["committed_flush"] == 2
                assert len(objects(f"{BUCKET}/cutoff/r1/tokens")) == 3
        lg.close()
    assert lg.manifest["committed_flush"] == 4 and lg.manifest["lost"]["first_step"] == 2
    assert len(objects(f"{BUCKET}/cutoff/r1/tokens")) == 4  # steps 0, 1, 3, 4
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        assert sorted(db.step_summary()["step"]) == [0, 1, 3, 4]
    assert only_rows_lost(CliRunner().invoke(app, ["validate", url]))  # the loss, named


def test_validate_names_problems_by_their_s3_path(endpoint):
    url = f"s3://{BUCKET}/broken"
    log_run(url, "r1", range(1))
    runformat.s3_filesystem().pipe_file(f"{BUCKET}/broken/r1/ranks/rank0001.json", b"{not json")
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 1
    assert f"{url}/r1/ranks/rank0001.json: unreadable rank manifest" in result.output
    result = CliRunner().invoke(app, ["validate", f"s3://{BUCKET}/empty"])
    assert result.exit_code == 1 and f"s3://{BUCKET}/empty: no run found" in result.output


@pytest.mark.slow
def test_readers_see_only_committed_flushes(endpoint, tmp_path):
    """An object no manifest commits (a writer of an older version killed between its uploads and its manifest
    PUT) is read by no trustscope reader; validate names it (a listing of the prefix would read it), and resuming
    the run removes it."""
    url = f"s3://{BUCKET}/uncommitted"
    log_run(url, "r1", range(2))
    fs = runformat.s3_filesystem()
    tokens = [o for o in objects(f"{BUCKET}/uncommitted/r1/tokens")]
    orphan = f"{BUCKET}/uncommitted/r1/tokens/{S.data_file_name(0, 7, 7, 3)}"
    fs.copy(tokens[0], orphan)
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        assert len(db._file_lists()["tokens"]) == 1 + 2  # the empty file, then the two committed flushes
        assert db.runs()["n_steps"].tolist() == [2]
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 1 and f"s3://{orphan}: read by tools that list the prefix" in result.output
    with TokenLogger(url, "r1", resume=True) as lg:
        lg.log_step(2, **step_data(2))
    assert orphan not in objects(f"{BUCKET}/uncommitted/r1/tokens")
    assert CliRunner().invoke(app, ["validate", url]).exit_code == 0
    assert lg.manifest["committed_flush"] == 3 and lg.manifest["rows"]["tokens"] == 3 * B * T


@pytest.mark.slow
def test_a_reader_during_logging_never_sees_half_a_flush(endpoint, tmp_path):
    """While a writer uploads flush after flush, every refresh of a reader sees whole steps, the same ones in
    every table. The writer waits (at most 5 s) for one refresh after each flush, so the reader's listings
    overlap the next flush's uploads and it sees the run grow."""
    url = f"s3://{BUCKET}/live"
    steps = 6
    refreshed, done = threading.Event(), threading.Event()

    def write():
        try:
            with TokenLogger(url, "r1", flush_seconds=3600) as lg:
                for step in range(steps):
                    lg.log_step(step, **step_data(step))
                    lg.flush()
                    refreshed.wait(5)
                    refreshed.clear()
        finally:
            done.set()

    log_run(url, "r0", range(1))  # so that the reader has a run to open
    seen = []
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        writer = threading.Thread(target=write)
        writer.start()
        while True:
            finished = done.is_set()
            db.refresh()
            cur = db.cursor()
            try:
                tokens = cur.execute("select step, count(*) from tokens where run_id = 'r1' group by step").fetchall()
                samples = cur.execute("select distinct step from samples where run_id = 'r1'").fetchall()
                summaries = cur.execute("select distinct step from summaries where run_id = 'r1'").fetchall()
            finally:
                cur.close()
            refreshed.set()
            assert all(n == B * T for _, n in tokens), tokens
            assert {s for s, _ in tokens} == {s for (s,) in samples} == {s for (s,) in summaries}
            seen.append(len(tokens))
            if finished:
                break
        writer.join()
    assert seen == sorted(seen) and seen[-1] == steps
    assert len(set(seen)) >= 3, f"the reader saw too few states of the run: {seen}"


def test_an_unreachable_endpoint_fails_at_open_with_the_url_and_the_cause(endpoint, tmp_path):
    url = f"s3://{BUCKET}/unreachable"
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(LogDirError, match=rf"{re.escape(url)}.*cannot be reached: EndpointConnectionError"):
        TokenLogger(url, "r1", storage_options=options)
    with pytest.raises(runformat.StorageError, match=rf"{re.escape(url)}.*cannot be reached"):
        connect(url, storage_options=options, mirror_dir=tmp_path)


def test_a_missing_bucket_fails_at_open_with_the_url_and_the_cause(endpoint, tmp_path):
    url = "s3://no-such-bucket/logs"
    with pytest.raises(LogDirError, match=r"s3://no-such-bucket/logs.*bucket 'no-such-bucket' does not exist"):
        TokenLogger(url, "r1")
    with pytest.raises(runformat.StorageError, match="bucket 'no-such-bucket' does not exist"):
        connect(url, mirror_dir=tmp_path)
    result = CliRunner().invoke(app, ["validate", url])
    assert result.exit_code == 2 and "bucket 'no-such-bucket' does not exist" in result.output


def test_a_bad_url_or_options_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="bucket name 'Bad_Bucket'"):
        TokenLogger("s3://Bad_Bucket/logs", "r1")
    with pytest.raises(ValueError, match="storage_options are for s3://"):
        TokenLogger(tmp_path, "r1", storage_options={"endpoint_url": "http://127.0.0.1:1"})


def test_object_storage_warns_that_it_has_no_lock(endpoint):
    with pytest.warns(LogWarning, match="object storage has no locks"), \
            TokenLogger(f"s3://{BUCKET}/lock", "r1") as lg:
        lg.log_step(0, **step_data(0))


def test_a_failed_upload_loses_its_flush_alone(endpoint, tmp_path, monkeypatch):
    """A flush whose upload fails is lost (counted in the manifest's ``lost``, the rank ends ``crashed``); the
    flushes before it stay committed and readable, the ones after it commit as usual."""
    url = f"s3://{BUCKET}/failing"
    real = runformat.ObjectStore.publish

    def unreachable(self, tmp, final, fsync):
        raise runformat.StorageError(f"cannot upload {self.url_of(final)}: connection reset")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogWarning)
        lg = TokenLogger(url, "r1", strict=False, flush_seconds=3600)
        for step in range(4):
            if step == 2:
                monkeypatch.setattr(runformat.ObjectStore, "publish", unreachable)
            lg.log_step(step, **step_data(step))
            lg.flush()
            monkeypatch.setattr(runformat.ObjectStore, "publish", real)
        lg.close()
    manifest = lg.manifest
    assert manifest["status"] == "crashed" and "connection reset" in manifest["error"]
    assert manifest["lost"]["rows"]["tokens"] == B * T and manifest["lost"]["first_step"] == 2
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        assert sorted(db.step_summary()["step"]) == [0, 1, 3]
    assert only_rows_lost(CliRunner().invoke(app, ["validate", url]))  # the loss, named


def test_a_slow_bucket_drops_counted_whole_sequences_under_the_memory_bound(endpoint, monkeypatch):
    """Uploads throttled to a fraction of the logging rate, ``on_full="drop"``: the buffered rows stay under the
    bound, log_step does not wait for the uploads, and what was not uploaded is exactly what run.json counts."""
    upload = runformat.ObjectStore.publish

    def slow(self, tmp, final, fsync):
        time.sleep(0.2)
        upload(self, tmp, final, fsync)

    monkeypatch.setattr(runformat.ObjectStore, "publish", slow)
    url, steps, bound = f"s3://{BUCKET}/slow", 10, 2 * B * T
    with (pytest.warns(LogWarning, match="dropped .* sequence"),
          TokenLogger(url, "slow", flush_rows=B * T, max_buffered_rows=bound, on_full="drop", summaries=False,
                      write_threads=1, compact_every=0, storage_options={"endpoint_url": endpoint}) as lg):
        t0 = time.perf_counter()
        for step in range(steps):
            lg.log_step(step, **step_data(step))
            assert lg.buffer["rows"] <= bound
        logging_s = time.perf_counter() - t0
    manifest, buffer = lg.manifest, lg.manifest["buffer"]
    assert logging_s < 1.0 and buffer["peak_rows"] <= bound and buffer["dropped_rows"] > 0
    assert manifest["rows"]["tokens"] + buffer["dropped_rows"] == steps * B * T
    assert manifest["rows"]["samples"] + buffer["dropped_sequences"] == steps * B
    assert manifest["rows"]["steps"] == steps  # the scalars of every step are kept


def test_a_resumed_run_on_s3_is_cut_back_to_the_checkpoint_step(endpoint, tmp_path):
    """A run on s3:// resumed from step 2 (steps 3 and 4 were logged before a crash, one of them compacted with
    the steps before): cut_back drops them on the store, the resumed steps are logged once; drop_steps_after cuts
    an s3:// run too, and a resume beyond the log goes on, counted as a logging incident naming the rank and the
    steps."""
    from trustscope.logger import drop_steps_after

    url = f"s3://{BUCKET}/resume"
    log_run(url, "r1", range(4))
    from trustscope.runformat.maintenance import compact_logdir

    compact_logdir(url, grace_s=0)  # the logger does not compact on an object store; trustscope compact does
    before = log_run(url, "r1", [4], resume=True)
    assert [r["flushes"] for r in before[S.COMPACTED_KEY]] == [[1, 4]]  # steps 0-3 merged: cut in a local copy
    with TokenLogger(url, "r1", resume=True) as lg:
        assert lg.cut_back(2) > 0
        for step in (3, 4, 5):
            lg.log_step(step, **step_data(step))
            lg.commit_step()
    assert lg.manifest["last_step"] == 5 and lg.manifest["rows"]["tokens"] == 6 * B * T
    with connect(url, cache=False, mirror_dir=tmp_path / "mirror") as db:
        cur = db.cursor()
        try:
            assert cur.execute("select step, count(*) from tokens group by step order by step").fetchall() == [
                (s, B * T) for s in range(6)]
        finally:
            cur.close()
    assert CliRunner().invoke(app, ["validate", url]).exit_code == 0
    assert drop_steps_after(f"{url}/r1", 3) > 0
    with TokenLogger(url, "r1", resume=True) as lg:
        assert lg.manifest["last_step"] == 3 and lg.manifest["rows"]["steps"] == 4
        # a resume beyond the log goes on: one warning, the incident in the manifest, nothing cut
        with pytest.warns(LogWarning, match=r"resumed after step 7, but rank 0 logged only up to step 3: steps 4-7"):
            assert lg.cut_back(7) == 0
        assert lg.incidents["resume_log_short"]["count"] == 1 and lg.manifest["rows"]["steps"] == 4
