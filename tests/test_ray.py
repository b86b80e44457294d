"""trustscope.distributed: the kept aggregates' first pass as Ray tasks, on a local Ray of 2 CPUs started once for
the module, gives the local pass's rows and answers; an unreachable cluster warns or raises, as the caller chose."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import ray
from typer.testing import CliRunner

from trustscope import db as tsdb
from trustscope.cli import app
from trustscope.distributed import (
    RayUnavailable,
    RayUnavailableWarning,
    TaskSpec,
    _unreachable,
    aggregate_files,
)
from trustscope.synthetic import SyntheticConfig, generate_run

pytestmark = pytest.mark.slow  # Ray's start-up alone takes 10-30 s on the shared 2-core machine

ROOT = Path(__file__).resolve().parents[1]
CFG = SyntheticConfig(tokens=1_600, steps=4, rows_per_file=300, edge_cases=True, seed=11)  # a file per step
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: the connection is refused at once
ANALYSES = ("step_summary", "blocked_fractions", "clipped_tokens", "ratio_vs_divergence", "bad_negative_updates")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Two runs of several tokens files each; run_b trained with grpo at its own (non-default) parameters."""
    root = tmp_path_factory.mktemp("ray") / "logs"
    generate_run(root, "run_a", CFG)
    generate_run(root, "run_b", SyntheticConfig(**{**CFG.__dict__, "seed": 12, "loss_rule": "grpo",
                                                   "loss_params": {"eps_low": 0.1, "eps_high": 0.3}}))
    return root


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs whose workers import this checkout's trustscope."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def _tokens_files(db: tsdb.LogDB) -> set[str]:
    return {str(f) for run in db.runs_dirs for f in tsdb.data_files(run, "tokens")}


def _sorted(table: pa.Table) -> pa.Table:
    keys = [c for c in table.column_names if not pa.types.is_floating(table.schema.field(c).type)]
    return table.sort_by([(k, "ascending") for k in keys])


def _assert_same_rows(got: pa.Table, want: pa.Table, what: str) -> None:
    """Same rows: every count, key and text exactly; float sums to 1e-12 relative, since the local pass's own sums
    differ in the last bits from one run to the next (DuckDB's threads merge in the order they finish)."""
    assert got.num_rows == want.num_rows > 0, what
    assert got.schema.names == want.schema.names, what
    got, want = _sorted(got), _sorted(want)
    for name in want.column_names:
        a, b = got.column(name), want.column(name)
        if pa.types.is_floating(b.type):
            np.testing.assert_allclose(a.to_numpy(zero_copy_only=False), b.to_numpy(zero_copy_only=False),
                                       rtol=1e-12, atol=0, err_msg=f"{what}.{name}")
        else:
            assert a.equals(b), f"{what}.{name}"


def test_ray_tasks_give_the_local_pass_rows_and_answers(logdir, local_ray, tmp_path):
    local = tsdb.connect(logdir, cache_dir=tmp_path / "local")
    on_ray = tsdb.connect(logdir, cache_dir=tmp_path / "cache", ray="auto")
    try:
        assert on_ray.ray is not None and local.ray is None
        for analysis in ANALYSES:
            want, got = getattr(local, analysis)(), getattr(on_ray, analysis)()
            _assert_same_rows(pa.Table.from_pandas(got, preserve_index=False),
                              pa.Table.from_pandas(want, preserve_index=False), analysis)
        for name in tsdb.CACHED_PARTIALS.values():  # the kept aggregates themselves, merged
            _assert_same_rows(on_ray._merged[name], local._merged[name], name)

        files = _tokens_files(on_ray)
        tasks = on_ray.ray.tasks
        # each file aggregated once for each partial view the analyses read (every one of them)
        assert len(files) >= 8 and on_ray.partials_computed == local.partials_computed == len(files) * len(
            tsdb.CACHED_PARTIALS)
        # every file was aggregated by exactly one task of each cold pass (one pass a partial view, as the analyses
        # first read each), each task in a Ray worker process, not in this one
        assert sorted(f for t in tasks for f in t.files) == sorted(list(files) * len(tsdb.CACHED_PARTIALS))
        assert len(tasks) >= 4 and len({t.task_id for t in tasks}) == len(tasks)
        driver = ray.get_runtime_context().get_worker_id()
        assert all(t.pid != os.getpid() and t.worker_id != driver and t.task_id for t in tasks)
        assert {t.node_id for t in tasks} == {ray.get_runtime_context().get_node_id()}
    finally:
        on_ray.close()
        local.close()

    # what the tasks computed went through the same kept-aggregate path: on disk, a new connection reads it (this
    # one names the cluster by its GCS address, which the TCP probe reaches)
    gcs = ray.get_runtime_context().gcs_address
    again = tsdb.connect(logdir, cache_dir=tmp_path / "cache", ray=gcs)
    plain = tsdb.connect(logdir, cache_dir=tmp_path / "cache")
    try:
        again.step_summary()
        plain.step_summary()
        assert again.ray.address == gcs and again.ray.tasks == []
        assert again.partials_computed == 0 and plain.partials_computed == 0
    finally:
        again.close()
        plain.close()


def test_an_unreachable_cluster_warns_and_the_local_pass_answers(logdir, tmp_path):
    with pytest.warns(RayUnavailableWarning, match=rf"'{UNREACHABLE}' cannot be reached: no connection to "
                                                   r"127\.0\.0\.1:1 .*aggregating on this machine"):
        db = tsdb.connect(logdir / "run_a", cache_dir=tmp_path, ray=UNREACHABLE)
    with db:
        assert db.ray is None
        assert db.step_summary().n_tokens.sum() > 0 and db.partials_computed == len(_tokens_files(db))


def test_an_unreachable_cluster_with_fallback_error_raises_at_connect(logdir, tmp_path):
    for address in (UNREACHABLE, f"ray://{UNREACHABLE}"):
        with pytest.raises(RayUnavailable, match=rf"Ray cluster '{address}' cannot be reached: no connection"):
            tsdb.connect(logdir, cache_dir=tmp_path, ray=address, ray_fallback="error")


def test_auto_probes_the_address_ray_would_join(monkeypatch):
    """``ray="auto"`` in a process not attached to Ray probes what ``ray.init("auto")`` would join: RAY_ADDRESS."""
    detached = SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", UNREACHABLE)
    assert _unreachable(detached, "auto").startswith(f"no connection to {UNREACHABLE} (")
    monkeypatch.setenv("RAY_ADDRESS", "headnode")
    assert _unreachable(detached, "auto") == "RAY_ADDRESS='headnode' is not HOST:PORT or ray://HOST:PORT"


def test_bad_ray_settings_name_the_value(logdir, tmp_path):
    with pytest.raises(ValueError, match="ray_fallback='ignore' is not one of warn, error"):
        tsdb.connect(logdir, cache_dir=tmp_path, ray_fallback="ignore")
    for address in ("nowhere", "host:port", ""):
        with pytest.raises(ValueError, match=rf"ray={address!r} is not 'auto', HOST:PORT or ray://HOST:PORT"):
            tsdb.connect(logdir, cache_dir=tmp_path, ray=address)


def test_report_on_ray_prints_the_local_report(logdir, local_ray, tmp_path):
    runner = CliRunner()

    def report(*flags: str, cache: str):  # a cache folder of its own: every invocation aggregates afresh
        return runner.invoke(app, ["report", str(logdir / "run_b"), *flags], terminal_width=200,
                             env={"TRUSTSCOPE_CACHE": str(tmp_path / cache)})

    here = report(cache="here")
    on_ray = report("--ray", "auto", cache="ray")
    assert here.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    assert on_ray.stdout == here.stdout and "run_b" in here.stdout
    assert len(list((tmp_path / "ray").rglob("*.parquet"))) == len(list((tmp_path / "here").rglob("*.parquet"))) > 0

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command reports the warning itself, on stderr
        fallback = report("--ray", UNREACHABLE, cache="here")  # kept: only the warning is new
    assert fallback.exit_code == 0 and fallback.stdout == here.stdout
    assert f"Ray cluster '{UNREACHABLE}' cannot be reached" in fallback.stderr

    failed = report("--ray", UNREACHABLE, "--ray-fallback", "error", cache="failed")
    assert failed.exit_code == 2 and failed.stdout == ""
    assert f"trustscope report: Ray cluster '{UNREACHABLE}' cannot be reached: no connection" in failed.stderr


def test_a_task_error_is_raised_as_its_own_class(logdir, local_ray, tmp_path, monkeypatch):
    """A tokens file that cannot be read when the pass reads it fails the pass with DuckDB's error naming the file,
    as the local pass does (Ray's error is also an instance of the task's exception class), so callers handle both
    alike. A file unreadable when the files are listed is left out and its run marked broken
    (``test_odd_logdirs.py``); this one is damaged between the listing and the read, which the driver's check
    is told not to see."""
    from trustscope.query import runs

    monkeypatch.setattr(runs, "unreadable_files", lambda files: {})
    for ray_address in (None, "auto"):
        logs = tmp_path / str(ray_address) / "logs"
        shutil.copytree(logdir, logs)
        with tsdb.connect(logs, cache=False, ray=ray_address) as db:
            broken = sorted((logs / "run_a" / "tokens").rglob("*.parquet"))[1]  # broken once the views are bound
            broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
            with pytest.raises(duckdb.Error, match=broken.name):
                db.step_summary()


def test_a_task_refuses_sql_other_than_the_drivers(logdir):
    """A node whose trustscope has other SQL would compute other rows: its tasks refuse, naming the fingerprints."""
    with tsdb.connect(logdir, cache=False) as db:
        spec = TaskSpec(db._rule_blocks, "0" * 64, db._params())
        files = sorted(_tokens_files(db))[:1]
        with pytest.raises(RuntimeError, match=r"differs from the driver's .* install the driver's trustscope"):
            aggregate_files(spec, files)
        good = TaskSpec(db._rule_blocks, db._fingerprint, db._params())
        [(name, tables)] = aggregate_files(good, files)
        assert name == files[0] and set(tables) == set(tsdb.CACHED_PARTIALS)
