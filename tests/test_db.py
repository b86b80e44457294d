"""trustscope.db: views over one or many runs, live runs, kept per-file aggregates, named analyses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from trustscope import db as tsdb
from trustscope.losses import get_loss, list_losses
from trustscope.synthetic import SyntheticConfig, generate_run

CFG = SyntheticConfig(tokens=6_000, steps=3, rows_per_file=1_000, edge_cases=True, seed=3)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("db")
    generate_run(root / "logs", "run_a", CFG)
    generate_run(root / "logs", "run_b", SyntheticConfig(**{**CFG.__dict__, "seed": 4, "loss_rule": "grpo"}))
    return root / "logs"


@pytest.fixture(scope="module")
def db(logdir, tmp_path_factory):
    conn = tsdb.connect(logdir, cache_dir=tmp_path_factory.mktemp("cache"))
    yield conn
    conn.close()


def _tokens(logdir, run="run_a"):
    return pq.read_table(logdir / run / "tokens").to_pandas()


def test_every_view_answers(db, tmp_path):
    def count(conn, view):
        return conn.sql(f"select count(*) as n from {view}").table.column("n")[0].as_py()

    for view in tsdb.VIEWS:
        if view != "token_dimensions":
            assert count(db, view) > 0, view
    # token_dimensions holds the runs logged in full without summary dimension rows: none of db's, one here
    assert count(db, "token_dimensions") == 0
    generate_run(tmp_path / "logs", "bare", SyntheticConfig(**{**CFG.__dict__, "summaries": False}))
    with tsdb.connect(tmp_path / "logs", cache_dir=tmp_path / "cache") as bare:
        assert count(bare, "token_dimensions") > 0


def test_connect_to_one_run_or_a_list(logdir, tmp_path):
    with tsdb.connect(logdir / "run_b", cache_dir=tmp_path) as one:
        assert one.runs().run_id.tolist() == ["run_b"]
    with tsdb.connect([logdir / "run_a", logdir / "run_b"], cache_dir=tmp_path) as both:
        assert both.runs().run_id.tolist() == ["run_a", "run_b"]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        tsdb.connect(tmp_path / "nowhere")


def test_rule_defaults_are_bound_from_the_registry(db):
    cur = db.cursor()
    try:
        for rule in list_losses():
            for key, value in get_loss(rule).defaults.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    got = cur.sql("select rule_param($r, $k)", params={"r": rule, "k": key}).fetchall()
                    assert got[0][0] == pytest.approx(value), (rule, key)
    finally:
        cur.close()


def test_step_summary_matches_a_numpy_reference(db, logdir):
    tokens = _tokens(logdir)
    summary = db.step_summary("run_a").set_index("step")
    assert list(summary.index) == [0, 1, 2]
    for step, rows in tokens.groupby("step"):
        mu, pi = np.exp(rows.mu_logprob.astype(float)), np.exp(rows.pi_logprob.astype(float))
        adv = rows.advantage.to_numpy()
        got = summary.loc[step]
        assert got.n_tokens == len(rows)
        assert got.mismatch_mean == pytest.approx(np.abs(pi - mu).mean(), rel=1e-9)
        assert got.mismatch_max == pytest.approx(np.abs(pi - mu).max(), rel=1e-9)
        assert got.prob_diff_min == pytest.approx((pi - mu).min(), rel=1e-9)
        assert got.n_bad_negative == ((adv < 0) & (mu - pi >= 0.5)).sum()
        grad = adv != 0  # blocked fractions count the tokens that carry gradient
        assert got.n_nonzero_advantage == grad.sum()
        assert got.trainer_blocked_frac == pytest.approx(1 - rows.kept[grad].mean())
        assert got.blocked_frac__pg_is == 0.0
        assert got.topk_tv_mean == pytest.approx(rows.topk_tv.astype(float).mean(), rel=1e-6)
    # the cached summary equals one computed from scratch
    fresh = tsdb.connect(logdir, cache=False)
    try:
        pd_fresh = fresh.step_summary("run_a").set_index("step")
        np.testing.assert_allclose(pd_fresh.mismatch_mean, summary.mismatch_mean)
        np.testing.assert_allclose(pd_fresh.blocked_frac__grpo, summary.blocked_frac__grpo)
    finally:
        fresh.close()


def test_named_analyses_return_their_documented_columns(db):
    bf = db.blocked_fractions("run_a", rules=["ppo_clip", "dppo_binary_tv"])
    assert list(bf.columns) == ["run_id", "step", "rule", "advantage_side", "n_blocked", "n_tokens", "blocked_frac"]
    assert set(bf.rule) == {"ppo_clip", "dppo_binary_tv"} and set(bf.advantage_side) == {
        "all", "positive", "negative"}
    assert (bf.blocked_frac == bf.n_blocked / bf.n_tokens).all()
    bad = db.bad_negative_updates()
    assert list(bad.columns) == ["run_id", "step", "n_tokens", "n_negative", "n_bad_negative",
                                 "bad_negative_rate", "reward_mean", "reward_std", "reward_change"]
    clipped = db.clipped_tokens("run_a", rules="ppo_clip", top=5)
    assert list(clipped.columns) == ["run_id", "rule", "rank", "token_id", "token_text", "n_blocked",
                                     "n_occurrences", "block_rate", "block_share", "mu_prob_mean", "mu_bucket",
                                     "entropy_mean"]
    assert clipped["rank"].tolist() == [1, 2, 3, 4, 5] and clipped.n_blocked.is_monotonic_decreasing
    hist = db.ratio_vs_divergence("run_a", divergences="binary_tv")
    assert set(hist.divergence) == {"binary_tv"} and (hist.ratio_lo < hist.ratio_hi).all()
    assert hist.n.sum() == db.step_summary("run_a").n_tokens.sum()
    toks = db.sample_tokens("run_a", 1, 0)
    assert toks.pos.tolist() == list(range(len(toks))) and "blocks_dppo_binary_tv" in toks
    assert toks.token_text.notna().all()
    assert len(db.samples("run_b", steps=2, limit=3)) == 3


def test_clipped_token_counts_match_rule_blocks(db):
    clipped = db.clipped_tokens("run_b", rules="grpo", top=3)
    for row in clipped.itertuples():
        n = db.sql(f"select count(*) as n from rule_blocks where run_id = 'run_b' and token_id = {int(row.token_id)}"
                   " and blocks_grpo and advantage != 0").table.column("n")[0].as_py()
        assert n == row.n_blocked


def test_bad_negative_updates_any_delta(db, logdir):
    tokens = _tokens(logdir, "run_b")
    got = db.bad_negative_updates("run_b", delta=0.2).set_index("step")
    for step, rows in tokens.groupby("step"):
        mu, pi = np.exp(rows.mu_logprob.astype(float)), np.exp(rows.pi_logprob.astype(float))
        assert got.loc[step].n_bad_negative == ((rows.advantage < 0) & (mu - pi >= 0.2)).sum()
    with pytest.raises(ValueError, match="delta"):
        db.bad_negative_updates(delta=-1)


def test_live_run_sees_whole_files_only_and_new_files(tmp_path):
    logdir = tmp_path / "logs"
    generate_run(logdir, "live", SyntheticConfig(tokens=3_000, steps=3, rows_per_file=500, edge_cases=False))
    files = sorted((logdir / "live" / "tokens").rglob("*.parquet"))
    held = tmp_path / "held"
    held.mkdir()
    for f in files[len(files) // 2:]:
        shutil.move(f, held / f.name)
    conn = tsdb.connect(logdir, cache_dir=tmp_path / "cache")
    try:
        before = conn.step_summary().n_tokens.sum()
        # a half-written file under the logger's temporary name is not seen
        (logdir / "live" / "tokens" / ".partial.parquet.tmp").write_bytes(b"PAR1 half a file")
        assert conn.step_summary().n_tokens.sum() == before
        moved = 0
        for f in held.iterdir():
            shutil.move(f, files[0].parent / f.name)
            moved += 1
        computed = conn.partials_computed
        after = conn.step_summary().n_tokens.sum()
        assert conn.partials_computed - computed == moved  # only the new files are aggregated
        assert after == sum(pq.read_metadata(f).num_rows for f in files) > before
        # a run that appears after connect is picked up too
        generate_run(logdir, "late", SyntheticConfig(tokens=1_000, steps=1, edge_cases=False))
        assert set(conn.step_summary().run_id) == {"live", "late"}
    finally:
        conn.close()


def test_kept_aggregates_are_reused_across_processes(logdir, tmp_path):
    with tsdb.connect(logdir, cache_dir=tmp_path) as first:
        expected = first.step_summary()
    stored = list((tmp_path / "step_partials").glob("*.parquet"))
    assert len(stored) == sum(1 for _ in logdir.glob("*/tokens/**/*.parquet"))
    with tsdb.connect(logdir, cache_dir=tmp_path) as second:
        np.testing.assert_allclose(second.step_summary().mismatch_mean, expected.mismatch_mean)
        assert second.partials_computed == 0
        second.step_summary()
        assert second.partials_computed == 0


def test_kept_aggregates_reach_the_disk_from_a_process_that_never_closes(logdir, tmp_path):
    """The disk's copies are written on a background thread; a process that exits without closing its connection
    (a short-lived command) still leaves every one, and a damaged copy is computed again, not raised."""
    import subprocess
    import sys

    code = ("import sys; from trustscope import db; c = db.connect(sys.argv[1], cache_dir=sys.argv[2]); "
            "c.step_summary()")
    done = subprocess.run([sys.executable, "-c", code, str(logdir), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    stored = sorted((tmp_path / "step_partials").glob("*.parquet"))
    assert len(stored) == sum(1 for _ in logdir.glob("*/tokens/**/*.parquet"))
    stored[0].write_bytes(stored[0].read_bytes()[:100])  # cut short
    with tsdb.connect(logdir, cache_dir=tmp_path) as again:
        again.step_summary()
        assert again.partials_computed == 1


def test_missing_values_stay_missing_in_the_macros(db):
    """A null logprob or top-K list gives a null metric, never the clamp bound (least/greatest skip nulls)."""
    row = db.sql(
        "select ratio(null, -1.0) as r, topk_tv(null, [-1.0]) as tv, topk_kl([-1.0], null) as kl, "
        "binary_kl_probs(0.5, null, -0.69, null) as bkl, log_bin(null, -3, 3, 10) as b"
    ).to_pandas().iloc[0]
    assert row.isna().all(), row.to_dict()


def test_decoupled_rules_never_block_tokens_without_pi_old(tmp_path):
    """A run that never recomputed pi_old: the rules anchored on it have nothing to block."""
    from trustscope.logger import TokenLogger

    rng = np.random.default_rng(0)
    b, t = 8, 6
    mu = np.log(rng.uniform(1e-4, 1.0, (b, t)))
    pi = np.log(rng.uniform(1e-4, 1.0, (b, t)))  # far from mu: a ratio anchored anywhere would block many
    with TokenLogger(tmp_path, "no-old") as logger:
        logger.log_step(0, tokens={"token_id": rng.integers(0, 50, (b, t)), "mu_logprob": mu, "pi_logprob": pi,
                                   "advantage": np.repeat([1.0, -1.0], b // 2)},
                        mask=np.ones((b, t), bool), samples={"prompt_id": np.arange(b) // 4})
    with tsdb.connect(tmp_path) as fresh:
        counts = fresh.sql(
            "select count(*) as n, count(*) filter (where blocks_minirl or blocks_minirl_tis "
            "or blocks_dppo_decoupled) as blocked, count(*) filter (where blocks_ppo_clip) as ppo from rule_blocks"
        ).to_pandas().iloc[0]
    assert counts["n"] == b * t and counts["ppo"] > 0 and counts["blocked"] == 0


def test_each_partial_view_is_aggregated_once_per_file_when_first_read(logdir, tmp_path):
    """An analysis aggregates each tokens file for the kept aggregates it reads, and only those (a report reads the
    clipped tokens alone: its cold pass leaves the other two views); each (file, view) is computed once, then kept
    in memory and on disk."""
    n_files = sum(1 for _ in logdir.glob("*/tokens/**/*.parquet"))
    with tsdb.connect(logdir, cache_dir=tmp_path) as conn:
        conn.step_summary()
        assert conn.partials_computed == n_files
        conn.kept.flush()
        assert len(list((tmp_path / "step_partials").glob("*.parquet"))) == n_files
        assert not list((tmp_path / "clipped_partials").glob("*.parquet"))  # not read yet: not computed
        conn.clipped_tokens()
        conn.ratio_vs_divergence()
        assert conn.partials_computed == 3 * n_files
        conn.step_summary()
        conn.clipped_tokens()
        conn.ratio_vs_divergence()
        assert conn.partials_computed == 3 * n_files  # nothing twice
    for view in ("step_partials", "clipped_partials", "histogram_partials"):
        assert len(list((tmp_path / view).glob("*.parquet"))) == n_files


@pytest.mark.parametrize("summaries", [False, True], ids=["sql-windows", "logged-bits"])
def test_a_response_split_across_a_flushs_parts_keeps_its_sequence_context(tmp_path, summaries):
    """Two encoders split a flush by row groups, so one response can lie in two part files: the cold pass reads
    a flush's parts together, and the sequence rules (cppo, gspo, geo_mask) count as with one file, whether the
    SQL computes them (no bits logged) or the logger's bits are read."""
    from trustscope.logger import TokenLogger

    rng = np.random.default_rng(3)
    B, T = 12, 40
    mu = np.log(rng.uniform(0.01, 1.0, (B, T))).astype(np.float32)
    tokens = {"token_id": rng.integers(0, 50, (B, T)), "mu_logprob": mu,
              "pi_logprob": np.minimum(mu + rng.normal(0, 0.3, (B, T)).astype(np.float32), 0),
              "advantage": np.repeat(rng.normal(size=(B, 1)).astype(np.float32), T, axis=1)}
    for threads in (1, 2):
        with TokenLogger(tmp_path / f"t{threads}", "run", row_group_size=50, write_threads=threads,
                         loss_rule="cppo", summaries=summaries) as lg:
            lg.log_step(0, tokens=tokens, mask=np.ones((B, T), dtype=bool),
                        samples={"sample_id": np.arange(B), "prompt_id": np.arange(B) // 4})
    assert len(list((tmp_path / "t2" / "run" / "tokens").rglob("*.parquet"))) == 2
    counts = []
    for threads in (1, 2):
        with tsdb.connect(tmp_path / f"t{threads}", cache_dir=tmp_path / f"cache{threads}") as conn:
            summary = conn.step_summary()
            counts.append(summary[[c for c in summary.columns if c.startswith("n_blocked")]])
            assert (conn.stored_bits_files > 0) == summaries
    assert counts[0].filter(like="cppo").to_numpy().sum() > 0
    pd.testing.assert_frame_equal(counts[0], counts[1])


def test_flushes_of_one_variant_share_a_query_up_to_the_row_cap(tmp_path, monkeypatch):
    """batch_flushes: flushes of one variant share a query until BATCH_ROWS rows, a flush's parts together;
    where the variant needs the windows, flushes of one rank whose steps overlap go to different queries (a
    response could lie in both), and a file whose name does not say its steps is a query of its own."""
    import pyarrow as pa

    from trustscope.query import partials

    def flush(name: str, rank: int = 0) -> list:
        folder = tmp_path / "run" / "tokens"
        folder.mkdir(parents=True, exist_ok=True)
        parts = [folder / f"{name}-p0{i}.parquet" for i in range(2)]
        for part in parts:
            pq.write_table(pa.table({"x": np.arange(10)}), part)
        return parts

    monkeypatch.setattr(partials, "BATCH_ROWS", 40)
    bits, other_bits = tsdb.Variant("a", False), tsdb.Variant("b", False)
    windows = tsdb.Variant("c", True)
    flushes = [flush("r0000-s00000000-00000009-f00000001"), flush("r0000-s00000010-00000019-f00000002"),
               flush("r0000-s00000020-00000029-f00000003"), flush("r0000-s00000005-00000012-f00000004"),
               flush("r0001-s00000000-00000009-f00000001"), flush("old-name"),
               flush("r0000-s00000030-00000039-f00000005")]
    variants = [bits, bits, bits, windows, windows, windows, other_bits]
    got = sorted((tuple(map(str, files)), str(v)) for files, v in partials.batch_flushes(flushes, variants))
    want = sorted((tuple(map(str, files)), str(v)) for files, v in [
        ([*flushes[0], *flushes[1]], bits), (flushes[2], bits),  # the row cap: 40 rows a query
        ([*flushes[3], *flushes[4]], windows),  # ranks 0 and 1: their responses never meet
        (flushes[5], windows), (flushes[6], other_bits)])
    assert got == want
    # overlapping steps of one rank with the windows: two queries
    overlap = partials.batch_flushes([flushes[0], flushes[3]], [None, None])
    assert sorted(len(files) for files, _ in overlap) == [2, 2]
    assert partials.batch_flushes([flushes[0], flushes[1]], [None, None]) == [([*flushes[0], *flushes[1]], None)]


def test_a_footer_is_read_again_once_its_file_changes(tmp_path):
    """``footer`` caches by path, size and modification time: a file cut short reads as a problem naming it, and
    the same path rewritten whole reads again (a repaired copy is picked up without a new connection)."""
    import os

    import pyarrow as pa

    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"x": list(range(1000))}), path)
    assert tsdb.footer(path).num_rows == 1000
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    problem = tsdb.footer(path)
    assert isinstance(problem, str) and problem.startswith("part.parquet: not a readable Parquet file")
    [(cut, why)] = tsdb.unreadable_files([path]).items()  # the frame check: the file's end marker is gone
    assert cut == path and why.startswith("part.parquet: not a readable Parquet file (no Parquet marker at its end")
    path.write_bytes(whole)
    os.utime(path, ns=(1, 1))  # a new modification time, whatever the clock's resolution
    assert tsdb.footer(path).num_rows == 1000 and tsdb.unreadable_files([path]) == {}
    path.unlink()
    assert "cannot be read" in tsdb.footer(path)


def test_a_compaction_merges_the_kept_aggregates_of_its_sources(tmp_path, monkeypatch):
    """A connection that kept the rows of the per-step files takes a compacted file's rows from them (no pass over
    its tokens), and answers as before; a new process reads them from the disk cache."""
    from test_compact import compact, log_steps

    log_steps(tmp_path / "logs", 0, 11)
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    with tsdb.connect(tmp_path / "logs") as db:
        before = db.step_summary()
        computed = db.partials_computed
        assert computed == len(tsdb.data_files(tmp_path / "logs" / "c", "tokens")) >= 12  # a file or two a step
        compact(tmp_path / "logs")
        after = db.step_summary()
        assert db.partials_computed == computed and db.kept.merged_from_sources >= 1
        assert len(db.kept.rows["step_partials"]) < computed  # the sources' rows are dropped
    pd.testing.assert_frame_equal(before, after, rtol=1e-12)
    with tsdb.connect(tmp_path / "logs") as again:
        pd.testing.assert_frame_equal(again.step_summary(), before, rtol=1e-12)
        assert again.partials_computed == 0
