"""trustscope explain: the Shapley allocation against a brute-force reference, and runs with injected causes (one at a
time and in mixtures) read back: the largest share on the injected cause, shares adding up to 1, the detectors'
evidence, the CLI's text and JSON, and causes that cannot be measured said so."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.db import connect
from trustscope.explain.allocate import pattern_sums, shapley_shares
from trustscope.explain.analysis import Thresholds, explain
from trustscope.explain.causes import CAUSES, UNEXPLAINED
from trustscope.explain.inject import InjectConfig, write_run

SHAPE = {"steps": 4, "responses": 24, "length": 48}
SINGLE = {"stale": "staleness", "routing": "routing", "drift": "token_drift", "temperature": "temperature",
          "top_p": "truncation", "shift": "position_shift"}
"""Injected cause -> the source explain must put the largest share on."""
MIXTURES = {"mix_stale_routing": ({"stale": 0.3, "routing": 0.2}, {"staleness", "routing"}),
            "mix_temperature_drift": ({"temperature": 0.25, "drift": 0.3}, {"temperature", "token_drift"})}


# ------------------------------------------------------------------------------------------------ the allocation


def _brute_shapley(values: np.ndarray, counts: np.ndarray, patterns: np.ndarray) -> np.ndarray:
    """The Shapley value of every cause of the game v(C) = sum over patterns S within C of max(V_S - b n_S, 0), by
    the permutation-free formula over every coalition: the slow reference."""
    n_causes = patterns.shape[1]
    untouched = ~patterns.any(axis=1)
    base = values[untouched].sum() / counts[untouched].sum()
    excess = np.where(untouched, 0.0, np.maximum(values - base * counts, 0.0))

    def v(coalition: set[int]) -> float:
        return float(sum(e for e, p in zip(excess, patterns, strict=True) if set(np.flatnonzero(p)) <= coalition))

    phi = np.zeros(n_causes)
    for i in range(n_causes):
        others = [j for j in range(n_causes) if j != i]
        for size in range(n_causes):
            for c in itertools.combinations(others, size):
                w = math.factorial(size) * math.factorial(n_causes - size - 1) / math.factorial(n_causes)
                phi[i] += w * (v(set(c) | {i}) - v(set(c)))
    return phi


def test_shapley_shares_match_the_brute_force_shapley_values():
    rng = np.random.default_rng(0)
    n_causes = 4
    patterns = np.array(list(itertools.product([False, True], repeat=n_causes)))  # (16, 4), row 0 untouched
    counts = rng.integers(1, 50, size=len(patterns)).astype(float)
    values = counts * rng.uniform(0.0, 2.0, size=len(patterns))
    shares, amounts = shapley_shares(values, counts, patterns)
    np.testing.assert_allclose(amounts[0, :-1], _brute_shapley(values, counts, patterns), rtol=1e-12)
    assert shares.sum() == pytest.approx(1.0, abs=1e-12)
    assert amounts[0].sum() == pytest.approx(values.sum(), rel=1e-12)


def test_shapley_shares_by_hand():
    # untouched: 10 tokens carrying 1.0 (baseline 0.1); {A}: 5 tokens, 5.5; {A, B}: 2 tokens, 4.2.
    patterns = np.array([[False, False], [True, False], [True, True]])
    shares, amounts = shapley_shares(np.array([1.0, 5.5, 4.2]), np.array([10.0, 5.0, 2.0]), patterns)
    np.testing.assert_allclose(amounts[0], [5.0 + 2.0, 2.0, 1.7])  # A: 5 + 4/2, B: 4/2, the rest: 10.7 - 9
    np.testing.assert_allclose(shares[0], np.array([7.0, 2.0, 1.7]) / 10.7)


def test_nothing_to_allocate_goes_to_the_remainder():
    shares, _ = shapley_shares(np.zeros((1, 2)), np.array([[3.0, 4.0]]), np.array([[False], [True]]))
    np.testing.assert_array_equal(shares[0], [0.0, 1.0])


def test_pattern_sums_weight_each_response():
    group, pattern, value = np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(pattern_sums(group, pattern, value, 2, 2), [[1.0, 5.0]])
    np.testing.assert_allclose(pattern_sums(group, pattern, value, 2, 2, np.array([[2.0, 0.0]])), [[2.0, 4.0]])


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="shift_factor"):
        Thresholds(shift_factor=-1)
    with pytest.raises(ValueError, match="window"):
        explain("/nonexistent", window=0)
    with pytest.raises(ValueError, match="replicates"):
        explain("/nonexistent", replicates=-3)


# ------------------------------------------------------------------------------------------------ injected runs


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    for seed, (name, _) in enumerate(SINGLE.items()):
        write_run(root, name, InjectConfig(causes={name: 0.3}, seed=seed, **SHAPE))
    for seed, (name, (causes, _)) in enumerate(MIXTURES.items(), start=10):
        write_run(root, name, InjectConfig(causes=causes, seed=seed, **SHAPE))
    write_run(root, "clean", InjectConfig(seed=20, **SHAPE))
    write_run(root, "bare", InjectConfig(causes={"stale": 0.3}, seed=21, **SHAPE),
              drop=("policy_version", "routing_agreement", "engine_token_id", "mu_topk_ids", "mu_topk_logprobs",
                    "pi_topk_logprobs"))
    write_run(root, "sampled", InjectConfig(causes={"routing": 0.3}, seed=22, token_fraction=0.5, **SHAPE))
    return root


@pytest.fixture(scope="module")
def explained(logdir):
    with connect(logdir, cache=False) as db:
        return {r.run_id: r for r in explain(db, replicates=100).runs}


def _shares(scope) -> dict[str, float]:
    return {c.source: c.share for c in scope.causes}


@pytest.mark.slow
@pytest.mark.parametrize(("run", "source"), list(SINGLE.items()))
def test_the_injected_cause_gets_the_largest_share(explained, run, source):
    shares = _shares(explained[run].run)
    assert max(shares, key=shares.get) == source, shares
    assert shares[source] > 0.5, shares


@pytest.mark.slow
@pytest.mark.parametrize("run", list(MIXTURES))
def test_a_mixture_puts_its_causes_first(explained, run):
    shares = _shares(explained[run].run)
    injected = MIXTURES[run][1]
    top = sorted(shares, key=shares.get, reverse=True)[: len(injected)]
    assert set(top) == injected, shares


@pytest.mark.slow
def test_shares_add_up_to_one_everywhere(explained):
    for r in explained.values():
        for scope in [r.run, *r.windows]:
            assert sum(c.share for c in scope.causes) == pytest.approx(1.0, abs=1e-9), r.run_id
            for rule, got in scope.rules.items():
                assert sum(c.share for c in got["causes"]) == pytest.approx(1.0, abs=1e-9), (r.run_id, rule)
            for c in scope.causes:
                assert c.low - 1e-12 <= c.share <= c.high + 1e-12 or not c.measurable, (r.run_id, c)


@pytest.mark.slow
def test_a_clean_run_is_all_unexplained(explained):
    clean = explained["clean"].run
    assert _shares(clean)[UNEXPLAINED] == 1.0
    assert all(c.tokens == 0 for c in clean.causes if c.source != UNEXPLAINED)


@pytest.mark.slow
def test_stale_tokens_carry_the_blocked_tokens_too(explained):
    got = explained["stale"].run.rules["ppo_clip"]
    assert got["blocked"] > 0
    shares = {c.source: c.share for c in got["causes"]}
    assert max(shares, key=shares.get) == "staleness", shares


@pytest.mark.slow
def test_absent_columns_are_not_measurable_never_a_silent_zero(explained):
    bare = {c.source: c for c in explained["bare"].run.causes}
    for source, needs in (("staleness", "`policy_version`"), ("routing", "`routing_agreement`"),
                          ("token_drift", "`engine_token_id`"), ("temperature", "`mu_topk_logprobs`"),
                          ("truncation", "`pi_topk_logprobs`")):
        assert not bare[source].measurable and bare[source].note.startswith("not measurable: needs"), source
        assert needs in bare[source].note
    assert bare["position_shift"].measurable  # mu and pi are always there


@pytest.mark.slow
def test_totals_are_exact_over_every_token_when_rows_are_sampled(explained):
    sampled = explained["sampled"].run
    every = SHAPE["steps"] * SHAPE["responses"] * SHAPE["length"]
    assert sampled.tokens == every and sampled.tokens_logged < every
    shares = _shares(sampled)
    assert max(shares, key=shares.get) == "routing"


@pytest.mark.slow
def test_windows_cover_the_run(explained):
    r = explained["stale"]
    assert [(w.first_step, w.last_step) for w in r.windows] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert sum(w.tokens for w in r.windows) == r.run.tokens


# ------------------------------------------------------------------------------------------------ the detectors


@pytest.fixture(scope="module")
def doctored(logdir):
    from trustscope import doctor as D

    with connect(logdir, cache=False) as db:
        found = D.diagnose(db, checks=[name for name in D.CHECKS if name.startswith("cause_")])
    return {run: {f.check: f for f in fs} for run, fs in found.items()}


@pytest.mark.slow
def test_each_detector_warns_on_its_cause_alone(doctored):
    checks = {c.source: f"cause_{c.source}" for c in CAUSES}
    for run, source in SINGLE.items():
        got = doctored[run]
        assert got[checks[source]].verdict == "warn" and got[checks[source]].examples, (run, got[checks[source]])
        others = [name for name in checks.values() if name != checks[source] and got[name].verdict == "warn"]
        assert not others, (run, others)
    assert all(f.verdict in ("ok",) for f in doctored["clean"].values()), doctored["clean"]


@pytest.mark.slow
def test_detector_evidence(doctored):
    assert doctored["temperature"]["cause_temperature"].evidence["fitted_temperature"] == pytest.approx(0.7, abs=0.03)
    assert "contradict" in doctored["temperature"]["cause_temperature"].summary  # run.json says temperature 1
    assert doctored["top_p"]["cause_truncation"].evidence["kept_mass"] == pytest.approx(0.9, abs=0.04)
    assert doctored["drift"]["cause_token_drift"].evidence["first_pos"] == SHAPE["length"] // 2
    stale = doctored["stale"]["cause_staleness"].evidence["by_staleness"]
    assert {row["staleness"] for row in stale} >= {0, 2}
    assert doctored["bare"]["cause_routing"].verdict == "skipped"
    assert doctored["bare"]["cause_routing"].summary == "not measurable: needs `routing_agreement`"


# ------------------------------------------------------------------------------------------------ the command


@pytest.mark.slow
def test_cli_json_lists_every_runs_causes(logdir):
    result = CliRunner().invoke(app, ["explain", str(logdir), "--format", "json", "--replicates", "20"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert {r["run_id"] for r in out["runs"]} == {*SINGLE, *MIXTURES, "clean", "bare", "sampled"}
    for r in out["runs"]:
        assert all({"source", "share"} <= set(c) for c in r["causes"])
        assert sum(c["share"] for c in r["causes"]) == pytest.approx(1.0, abs=1e-9)
    bare = {c["source"]: c for c in next(r for r in out["runs"] if r["run_id"] == "bare")["causes"]}
    assert bare["routing"]["measurable"] is False and "needs `routing_agreement`" in bare["routing"]["note"]


@pytest.mark.slow
def test_cli_text_and_errors(logdir):
    result = CliRunner().invoke(app, ["explain", str(logdir), "--run", "bare", "--replicates", "0"])
    assert result.exit_code == 0, result.output
    assert "not measurable: needs `routing_agreement`" in result.output and "staleness" in result.output
    missing = CliRunner().invoke(app, ["explain", str(logdir), "--run", "nope"])
    assert missing.exit_code == 2 and "nope" in missing.output
    bad = CliRunner().invoke(app, ["explain", str(logdir), "--window", "0"])
    assert bad.exit_code == 2 and "window=0" in bad.output


@pytest.mark.slow
def test_rules_read_from_the_bits_agree_with_rule_blocks(logdir, explained):
    """The logger's blocked_rules bits (the fast path) and every rule evaluated in SQL (the path of runs without
    bits) count the same blocked tokens for each rule at its default parameters; the run's own rule is the trainer's
    kept mask."""
    from dataclasses import asdict

    with connect(logdir, cache=False) as db:
        sql = db.query("explain_rule_blocks", run_ids=["mix_stale_routing"], first_step=None,
                       **asdict(Thresholds()))
    rules = explained["mix_stale_routing"].run.rules
    assert rules["ppo_clip"]["from"].startswith("the trainer's own mask")
    compared = [r for r in rules if rules[r]["from"].startswith("the logger's")]
    assert "dppo_binary_tv" in compared and "cispo" in compared
    for rule in compared:
        assert rules[rule]["blocked_logged"] == int(sql[f"blocks_{rule}"].sum()), rule
