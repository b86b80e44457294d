"""Rule settings and rules at an equal budget: parameters as users write them, the logger's summaries of several
settings of one rule, equal-budget thresholds read back and recounted from every token."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.db import connect
from trustscope.losses import get_loss, list_losses
from trustscope.query.budget import EQUAL_WITHIN
from trustscope.rule_settings import check_budget, parse_setting, rule_params_of
from trustscope.synthetic import SyntheticConfig, generate_run

SETTINGS = ("geo_mask@0.99", "geo_mask@0.9", "ppo_clip:eps_low=0.1,eps_high=0.1")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Two runs of a rule that blocks nothing (every other rule is a counterfactual one), 6,000 tokens each,
    every token logged: one with the logger's summaries and rule settings, one without summaries."""
    root = tmp_path_factory.mktemp("budget")
    base = {"tokens": 6_000, "steps": 3, "loss_rule": "pg_is", "mismatch": 0.05}
    generate_run(root, "summ", SyntheticConfig(**base, rule_settings=SETTINGS))
    generate_run(root, "rows", SyntheticConfig(**base, summaries=False, seed=1))
    return root


def _recount(logdir, run_id: str, params: dict[str, dict]) -> dict[str, int]:
    """Each rule's blocked tokens with A != 0 on ``run_id`` at ``params``, counted from every logged token by the
    rules' masks (rule_blocks), not by the scores the equal budget was solved on."""
    with connect(logdir, rule_params=params, cache=False) as db:
        df = db.blocked_fractions(run_id)
    df = df[df["advantage_side"] == "all"]
    return df.groupby("rule")["n_blocked"].sum().astype(int).to_dict()


def test_settings_round_trip_and_move_the_threshold_with_what_scales_with_it():
    for name in list_losses():
        rule = get_loss(name)
        if rule.threshold is None:
            continue
        value = rule.defaults[rule.threshold.param] * (1.3 if dict(rule.threshold.scaled)[rule.threshold.param]
                                                       == "linear" else 0.9)
        setting = parse_setting(f"{name}@{value}")
        assert parse_setting(setting.name) == setting, name
        assert setting.params[rule.threshold.param] == pytest.approx(value)
    geo = parse_setting("geo_mask@0.99")
    assert geo.name == "geo_mask@0.99" and geo.params["high"] == pytest.approx(1.001 ** (math.log(0.99) /
                                                                                        math.log(0.999)))
    clip = parse_setting("ppo_clip:eps_high=0.1,eps_low=0.1")
    assert clip.name == "ppo_clip:eps_low=0.1,eps_high=0.1" and parse_setting(clip.name) == clip
    assert rule_params_of(["dppo_binary_tv:delta=0.05"]) == {"dppo_binary_tv": {"divergence": "binary_tv",
                                                                                 "delta": 0.05}}


@pytest.mark.parametrize(("text", "words"), [
    ("nope@1", ["unknown rule 'nope'", "registered rules"]),
    ("dppo_binary_tv:delt=0.1", ["'dppo_binary_tv'", "no parameter 'delt'", "delta ([0, inf))"]),
    ("dppo_binary_tv:delta=-1", ["'dppo_binary_tv'", "delta=-1.0", "bounds [0, inf)"]),
    ("ppo_clip:eps_low=1.5", ["'ppo_clip'", "eps_low=1.5", "bounds [0, 1)"]),
    ("geo_mask@2", ["'geo_mask'", "high=", "> low"]),
    ("cispo@2", ["'cispo'", "no scalar threshold"]),
    ("ppo_clip@x", ["not a number"]),
])
def test_bad_settings_name_the_rule_the_parameter_the_value_and_the_bounds(text, words):
    with pytest.raises(ValueError) as err:
        parse_setting(text)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("share", [0, 1, 1.5, -0.1, "0.1", True])
def test_a_budget_outside_zero_one_is_refused(share):
    with pytest.raises(ValueError, match=r"outside \(0, 1\)"):
        check_budget(share)


def test_the_summaries_count_each_setting_under_its_name_at_the_parameters_it_names(logdir):
    manifest = json.loads((logdir / "summ" / "run.json").read_text())
    recorded = manifest["logging"]["summary_rules"]
    with connect(logdir, cache=False) as db:
        summ = db.summaries("summ", "blocked")
    counted = summ.groupby("rule")["count"].sum()
    for text in SETTINGS:
        setting = parse_setting(text)
        assert recorded[setting.name]["rule"] == setting.rule
        assert recorded[setting.name]["params"] == {p: setting.params[p] for p in get_loss(setting.rule).mask_params}
        rows = _recount(logdir, "summ", {setting.rule: dict(setting.params)})
        assert counted.get(setting.name, 0) == rows[setting.rule], setting.name  # every token is logged here
    assert counted["geo_mask@0.9"] <= counted["geo_mask@0.99"] <= counted["geo_mask"]


def test_equal_budget_thresholds_recount_to_the_budget_from_every_token(logdir):
    budget = 0.05
    with connect(logdir, cache=False) as db:
        eb = db.equal_budget(budget=budget)
    solved = eb[eb["value"].notna()]
    thresholded = {n for n in list_losses() if get_loss(n).threshold is not None}
    assert set(eb.loc[eb["param"].isna(), "rule"]) == {n for n in list_losses()
                                                        if get_loss(n).sql and n not in thresholded}
    assert {"summ", "rows"} == set(solved["run_id"])
    for run_id in ("summ", "rows"):
        mine = solved[solved["run_id"] == run_id]
        # every token is logged here: a rule the summaries' bins bracket no closer than 1% is cut on the rows
        assert len(mine) >= 10, mine[["rule", "source"]]
        at = {end: {r.rule: json.loads(r.params) if end == "value" else
                    dict(get_loss(r.rule).threshold.at(get_loss(r.rule).threshold.scale_of(getattr(r, end),
                                                                                            get_loss(r.rule).defaults),
                                                       get_loss(r.rule).defaults))
                    for r in mine.itertuples()} for end in ("value", "value_low", "value_high")}
        counts = {end: _recount(logdir, run_id, params) for end, params in at.items()}
        for r in mine.itertuples():
            # the setting the result names reads back to the parameters it was solved at
            assert json.loads(r.params) == {p: parse_setting(r.setting).params[p]
                                            for p in get_loss(r.rule).mask_params}
            assert counts["value"].get(r.rule, 0) == r.n_blocked, (run_id, r.rule)
            assert r.target_blocked == round(budget * r.n_tokens)
            assert r.off == pytest.approx((r.n_blocked - r.target_blocked) / r.target_blocked), r.rule
            if r.source.startswith("summaries"):  # exact to a bin edge: the two ends bracket the budget
                low, high = sorted((counts["value_low"].get(r.rule, 0), counts["value_high"].get(r.rule, 0)))
                assert {low, high} == {r.n_blocked_low, r.n_blocked_high}, r.rule
                assert low <= r.target_blocked <= high, r.rule
                assert abs(r.off) <= EQUAL_WITHIN, r.rule  # kept only where the bin edge is within 1%
            else:  # an exact cut: the nearest count the rule can block (whole responses for a sequence rule)
                seq = get_loss(r.rule).sql.sequence
                # tied scores move together too; the note says whether the count is the target
                assert abs(r.n_blocked - r.target_blocked) <= (200 if seq else 0.002 * r.n_tokens), r.rule
                assert (r.note == "exact") == (r.n_blocked == r.target_blocked), r.rule
                if not seq and r.note == "exact":
                    assert r.off == 0, r.rule


def test_every_rule_of_a_run_logged_in_full_blocks_the_target_to_within_one_percent(logdir):
    """At an equal budget every rule's count, recounted from every token row by its own mask at the threshold
    found, is the target's to within 1%, or the note names the ties (whole responses, tied scores) that keep an
    exact cut from coming nearer; the error is the column ``off``."""
    with connect(logdir, cache=False) as db:
        eb = db.equal_budget("summ", budget=0.03)
    solved = eb[eb["value"].notna()]
    assert len(solved) >= 10
    counted = _recount(logdir, "summ", {r.rule: json.loads(r.params) for r in solved.itertuples()})
    for r in solved.itertuples():
        assert counted.get(r.rule, 0) == r.n_blocked, r.rule
        assert r.target_blocked == round(0.03 * r.n_tokens)
        off = (counted.get(r.rule, 0) - r.target_blocked) / r.target_blocked
        assert r.off == pytest.approx(off), r.rule
        assert abs(off) <= EQUAL_WITHIN or r.note.startswith("nearest count"), (r.rule, off, r.source, r.note)


def test_equal_budget_defaults_to_the_runs_own_rule_and_says_which_rules_cannot(logdir, tmp_path):
    generate_run(tmp_path, "clip", SyntheticConfig(tokens=3_000, steps=2, loss_rule="ppo_clip", mismatch=0.05))
    with connect(tmp_path, cache=False) as db:
        eb = db.equal_budget("clip", rules=["ppo_clip", "dppo_binary_tv", "cispo"])
        totals = db.overview(["clip"]).blocked_totals().set_index("rule")
    own = totals.loc["ppo_clip"]
    row = eb.set_index("rule")
    assert row.loc["dppo_binary_tv", "target_frac"] == pytest.approx(own.n_blocked / own.n_tokens)
    assert "ppo_clip (the run's rule" in row.loc["dppo_binary_tv", "reference"]
    assert "no scalar threshold" in row.loc["cispo", "note"] and math.isnan(row.loc["cispo", "value"])
    with connect(tmp_path, cache=False) as db, pytest.raises(ValueError, match="outside"):
        db.equal_budget("clip", budget=1.2)


def test_threshold_curve_marks_the_default_and_falls_with_the_threshold(logdir):
    with connect(logdir, cache=False) as db:
        curve = db.threshold_curve("summ", ["dppo_binary_tv", "geo_mask"])
        totals = db.overview(["summ"]).blocked_totals().set_index("rule")
    for rule, one in curve.groupby("rule"):
        one = one.sort_values("scale")
        assert one["blocked_frac"].is_monotonic_decreasing
        assert (one["default"] == get_loss(rule).defaults[get_loss(rule).threshold.param]).all()
        at_edge = one[one["scale"] == 1.0]
        if len(at_edge):  # the count at the default, from the threshold histogram, is the blocked count
            assert int(at_edge["n_blocked"].iloc[0]) == int(totals.loc[rule, "n_blocked"])


def test_picks_and_overlap_at_the_equal_budget_add_up(logdir):
    with connect(logdir, cache=False) as db:
        eb = db.equal_budget("rows", budget=0.1)
        picks = db.budget_picks("rows", eb)
        overlap = db.budget_overlap("rows", eb, "ppo_clip", "dppo_binary_tv")
    blocked = eb.set_index("rule")["n_blocked"]
    for dimension, part in picks[picks["rule"] == "ppo_clip"].groupby("dimension"):
        assert part["n_blocked"].sum() == blocked["ppo_clip"], dimension
    by = overlap.groupby("pick")["n"].sum()
    assert by.get("both", 0) + by.get("only a", 0) == blocked["ppo_clip"]
    assert by.get("both", 0) + by.get("only b", 0) == blocked["dppo_binary_tv"]


@pytest.mark.parametrize("command", [["report"], ["doctor"], ["sql", "select 1"], ["dashboard"]])
def test_the_rule_option_refuses_bad_input_naming_the_parameter_and_its_bounds(logdir, command):
    args = [command[0], str(logdir), *command[1:], "--rule", "dppo_binary_tv:delta=-2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "dppo_binary_tv" in result.output and "delta=-2.0" in result.output and "[0, inf)" in result.output


def test_report_shows_rules_at_an_equal_budget_and_a_chosen_setting(logdir):
    result = CliRunner().invoke(app, ["report", str(logdir / "rows"), "--budget", "0.1",
                                      "--rule", "geo_mask@0.9"])
    assert result.exit_code == 0, result.output
    assert "rules at an equal budget" in result.output and "10.00%" in result.output
    assert "geo_mask at the parameters given (--rule)" not in result.output  # a run without summaries: rows anyway
    assert any(line.startswith("geo_mask") and "0.900 ->" in line for line in result.output.splitlines())
    bad = CliRunner().invoke(app, ["report", str(logdir), "--budget", "1.5"])
    assert bad.exit_code == 2 and "outside (0, 1)" in bad.output


def test_a_run_too_large_to_cut_on_its_rows_is_said_so_and_its_summaries_still_answer(logdir):
    with connect(logdir, cache=False) as db:
        eb = db.equal_budget(budget=0.05, max_rows=100)
    rows = eb[(eb["run_id"] == "rows") & eb["param"].notna()]
    assert rows["value"].isna().all() and rows["note"].str.startswith("not cut").all()
    summ = eb[(eb["run_id"] == "summ") & eb["source"].fillna("").str.startswith("summaries")]
    assert len(summ) >= 10 and summ["value"].notna().all()


def test_picks_by_turn_and_staleness_where_logged_recount_from_the_masks(tmp_path):
    """At an equal budget, the picks by turn and staleness add up to each rule's blocked count and match a recount
    by the rule's own mask at the solved threshold, group by group; a run that logged neither has no such rows."""
    from async_logs import write_async_logdir

    logdir = write_async_logdir(tmp_path / "logs")
    # counterfactual rules: a connection binds the run's own rule (dppo_binary_tv) at the parameters it trained
    # with whatever rule_params says, so only another rule's mask can be recounted at the moved threshold
    rules = ["dppo_binary_kl", "ppo_clip"]
    with connect(logdir, cache=False) as db:
        eb = db.equal_budget("async-lag3", budget=0.1, rules=rules)
        picks = db.budget_picks("async-lag3", eb)
        plain = db.budget_picks("sync-single-turn", db.equal_budget("sync-single-turn", budget=0.1, rules=rules))
    assert {"turn", "staleness"} <= set(picks["dimension"])
    assert not {"turn", "staleness"} & set(plain["dimension"])
    solved = eb.set_index("rule")
    assert set(picks.loc[picks["dimension"] == "staleness", "value"]) == {"0", "1", "2", "3"}
    for rule in rules:
        params = json.loads(solved.loc[rule, "params"])
        with connect(logdir, rule_params={rule: params}, cache=False) as db:
            truth = db.sql(
                f"select t.turn::varchar as turn, t.staleness::varchar as staleness, count(*) as n "
                f"from rule_blocks r join tokens t using (run_id, step, rank, sample_id, pos) "
                f"where r.run_id = 'async-lag3' and r.advantage <> 0 and r.blocks_{rule} "
                f"group by all").to_pandas()
        assert int(truth["n"].sum()) == int(solved.loc[rule, "n_blocked"]) > 0
        mine = picks[picks["rule"] == rule]
        for dimension in ("turn", "staleness"):
            got = mine[mine["dimension"] == dimension].set_index("value")["n_blocked"].to_dict()
            want = truth.groupby(dimension)["n"].sum().to_dict()
            assert got == want, (rule, dimension)
