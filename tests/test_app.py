"""Every dashboard page under Streamlit's AppTest: key elements render and no exception escapes.

Runs over ``sample_logs/`` when it holds runs, else over a small synthetic log. Broken log directories (empty,
still being written, corrupt) must show a message, never a traceback.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from app import data
from app.launch import LOGDIR_ENV
from trustscope import runformat

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "app" / "main.py"
SAMPLE_LOGS = ROOT / "sample_logs"
TIMEOUT = 60


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """sample_logs/ when it holds runs, else a small synthetic log of two runs."""
    if runformat.run_dirs(SAMPLE_LOGS):
        return SAMPLE_LOGS
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    return generate_logdir(tmp_path_factory.mktemp("logs"), runs=2, config=SyntheticConfig(tokens=6_000, steps=4))


def _open(monkeypatch, logdir: Path, page: str | None = None) -> AppTest:
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    if page is not None:
        at.switch_page(f"views/{page}.py")
        at.run()
    return at


def _ok(at: AppTest, title: str) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert [t.value for t in at.title] == [title]


def _array(values: object) -> np.ndarray:
    """A trace's values from a chart's JSON: a list, or plotly's typed array (``{"dtype", "bdata"}``)."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values)


def _charts(at: AppTest) -> list:
    return list(at.get("plotly_chart"))


def test_runs_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir)
    _ok(at, "Runs")
    table = at.dataframe[0].value
    assert {"run_id", "status", "loss_rule", "n_steps", "tokens_generated", "tokens_logged",
            "updated_at"} <= set(table.columns) and len(table) >= 1
    assert "running" not in set(table["status"])  # every sample run's writer is long gone
    assert len(_charts(at)) == 3  # the metrics, the early-warning signals, the blocked fractions
    signals = json.loads(_charts(at)[1].proto.spec)
    titles = [a["text"] for a in signals["layout"]["annotations"]]
    assert titles and set(titles) <= set(data.SIGNAL_TITLES.values()) and all(len(t["y"]) for t in signals["data"])
    picked = at.multiselect(key="group_picker").value
    rules = table.drop_duplicates("group").set_index("group")["loss_rule"]
    assert 1 <= len(picked) <= 4 and len({rules[g] for g in picked}) == len(picked)
    if "ppo_clip" in set(table["loss_rule"]):
        assert rules[picked[0]] == "ppo_clip"  # the baseline is always in the default selection
    contrast = set(data.CONTRAST_RULES) & set(table["loss_rule"])
    if contrast:  # then a rule without a trust region (the sample logs' PG-IS, which collapses)
        assert rules[picked[1 if "ppo_clip" in set(table["loss_rule"]) else 0]] in contrast, picked
    assert f"`{logdir.resolve()}`" in at.sidebar.caption[0].value
    # the collapse warning: red only where it holds (the reward then collapsed, or still on), the reason beside it;
    # a warning the reward never bore out is a grey line with its figures, as the report marks `!`
    badges = [m.value for m in at.markdown if m.value.startswith(":red[:material/warning:")]
    assert all(": the reward then collapsed" in b or "still on at the last step" in b for b in badges), badges
    quiet = [c.value for c in at.caption if "not borne out" in c.value]
    labels = [e.label for e in at.expander if "Collapse warning" in e.label or "No collapse warning" in e.label]
    if badges or quiet:
        warned = len(badges) + len(quiet)
        assert len(labels) == (1 if warned > 1 else 0), labels
        if labels:  # the count the expander names is the red lines under it
            assert (f"holds on {len(badges)} of " in labels[0]) if badges else labels[0].startswith(
                ":material/info: No collapse warning holds"), (labels, badges)


def test_runs_page_groups_seeds_and_smooths(monkeypatch, logdir):
    at = _open(monkeypatch, logdir)
    fig = json.loads(_charts(at)[0].proto.spec)
    groups = at.multiselect(key="group_picker").value
    assert [t["name"] for t in fig["data"] if t.get("showlegend") is not False] == groups
    at.select_slider(key="smoothing").set_value(0.9).run()
    _ok(at, "Runs")
    smoothed = json.loads(_charts(at)[0].proto.spec)
    assert smoothed["data"][0]["y"] != fig["data"][0]["y"]
    at.toggle(key="group_seeds").set_value(False).run()
    _ok(at, "Runs")
    assert at.multiselect(key="run_id_picker").value


def test_runs_page_one_metric(monkeypatch, logdir):
    at = _open(monkeypatch, logdir)
    at.multiselect(key="metrics_picker").set_value(["mismatch"]).run()
    _ok(at, "Runs")
    fig = json.loads(_charts(at)[0].proto.spec)
    assert fig["layout"]["yaxis"]["title"]["text"] == "mismatch mean |pi - mu|"
    assert fig["layout"]["yaxis"]["type"] == "log"
    assert all(len(trace["y"]) > 0 for trace in fig["data"])


def test_live_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "live")
    _ok(at, "Live")
    labels = [m.label for m in at.metric]
    assert labels == ["Last step", "Tokens logged", "Mean reward", "Status"]
    assert len(_charts(at)) == 2  # the metrics and the early-warning signals
    assert any("Refreshed" in c.value for c in at.caption)


def test_live_page_slows_its_refresh_when_a_refresh_is_slow(monkeypatch, logdir):
    """A refresh that takes longer than half the chosen interval re-arms the timer at twice its time, so a busy
    server's reader sees a finished page between refreshes; the caption says so."""
    import math
    import re
    import time

    runs = data.runs

    def slow_runs():
        time.sleep(1.6)
        return runs()

    at = _open(monkeypatch, logdir, "live")
    monkeypatch.setattr(data, "runs", slow_runs)
    at.select_slider(key="live_every").set_value(2).run()
    _ok(at, "Live")
    assert at.session_state["live_took"] >= 1.6
    caption = next(c.value for c in at.caption if "Refreshed" in c.value)
    # the interval drawn is the one the last refresh's time set (the time the caption shows beside it)
    found = re.search(r"\(every (\d+) s: a refresh takes (\d+\.\d) s\)", caption)
    assert found, caption
    every, took = int(found[1]), float(found[2])
    assert took >= 1.6 and every > 2, caption
    assert math.ceil(2 * (took - 0.05)) <= every <= math.ceil(2 * (took + 0.05)), caption  # took shown to 0.1 s


def test_live_page_picks_up_new_files(monkeypatch, tmp_path):
    from trustscope.synthetic import SyntheticConfig, generate_run

    generate_run(tmp_path, "first", SyntheticConfig(tokens=400, steps=2, edge_cases=False))
    at = _open(monkeypatch, tmp_path, "live")
    _ok(at, "Live")
    assert at.selectbox(key="live_run").value == "first" and at.metric[0].value == "1"
    generate_run(tmp_path, "second", SyntheticConfig(tokens=600, steps=3, edge_cases=False, seed=1))
    at.run()
    _ok(at, "Live")
    assert at.selectbox(key="live_run").options == ["first", "second"]
    assert at.selectbox(key="live_run").value == "first"  # the run being watched stays picked
    at.selectbox(key="live_run").set_value("second").run()
    _ok(at, "Live")
    assert at.metric[0].value == "2"


def test_bad_updates_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "bad_updates")
    _ok(at, "Bad negative updates")
    assert [m.label for m in at.metric][:2] == ["Bad updates (all steps)", "Worst step"]
    assert " of " in at.metric[0].value  # the fraction comes with its counts
    fig = json.loads(_charts(at)[0].proto.spec)
    assert [t["name"] for t in fig["data"]] == ["bad negative updates", "reward fluctuation"]
    assert fig["layout"]["yaxis"]["rangemode"] == "tozero"
    assert {"step", "bad_rate", "reward_fluctuation"} <= set(at.dataframe[0].value.columns)


def test_ratio_divergence_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "ratio_divergence")
    _ok(at, "Ratio vs divergence")
    figure2, histogram, spread = (json.loads(c.proto.spec) for c in _charts(at))
    names = [t["name"] for t in figure2["data"]]
    assert names == sorted(names) and len(names) >= 2  # one pair of traces per mu bucket, in bucket order
    assert figure2["layout"]["xaxis"]["type"] == "log"
    assert sum(len(t["x"]) for t in histogram["data"]) > 0
    assert [t["name"] for t in spread["data"]] == ["|ratio - 1|", "binary TV |pi - mu|"]
    assert any("Spearman" in c.value for c in at.caption)
    at.radio(key="divergence").set_value("topk_tv").run()
    _ok(at, "Ratio vs divergence")
    fig = json.loads(_charts(at)[0].proto.spec)
    assert fig["layout"]["yaxis2"]["title"]["text"] == "top-K TV"


def test_rules_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "rules")
    _ok(at, "Rules side by side")
    picked = at.multiselect(key="rules_picker").value
    assert picked
    fig = json.loads(_charts(at)[0].proto.spec)
    assert {t["meta"]["rule"] for t in fig["data"]} == set(picked)
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["advantage A>0", "advantage A<0"]
    table = at.dataframe[0].value
    assert {"mu_bucket", "adv_sign", "n_tokens", *picked} == set(table.columns)
    assert all(" of " in v for v in table[picked[0]])  # every fraction with its counts
    at.multiselect(key="rules_picker").set_value(["grpo"]).run()
    _ok(at, "Rules side by side")
    assert {t["meta"]["rule"] for t in json.loads(_charts(at)[0].proto.spec)["data"]} == {"grpo"}


def test_counterfactual_page_opens_at_an_equal_budget(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "counterfactual")
    _ok(at, "Counterfactual")
    assert at.segmented_control(key="cf_mode").value == "At an equal budget"
    table = at.dataframe[0].value
    assert {"rule", "threshold", "blocks", "setting"} <= set(table.columns) and len(table) >= 5
    counts = [int(b.split("(")[1].split(" of ")[0].replace(",", "")) for b in table["blocks"]]
    totals = {int(b.split(" of ")[1].rstrip(")").replace(",", "")) for b in table["blocks"]}
    assert len(totals) == 1  # every rule over the same tokens
    targets = {int(o.split(" of ")[1].split()[0].replace(",", "")) for o in table["off"]}
    assert len(targets) == 1  # one target: an equal budget
    target = targets.pop()
    for n, off in zip(counts, table["off"], strict=True):  # each count's distance from it, said beside it
        share = (n - target) / target
        said = "0" if n == target else f"{share:+.1%}" if abs(share) >= 0.001 else f"{share:+.2%}"
        assert off.startswith(f"{said} of {target:,}"), (n, off)
    curves, picks = (json.loads(c.proto.spec) for c in _charts(at)[:2])
    shown = {r.removesuffix(" (applied)") for r in table["rule"]}
    assert len(shown) == len(table) and {t["meta"]["rule"] for t in curves["data"]} >= shown
    assert curves["layout"]["xaxis"]["type"] == "log" and curves["data"][0]["name"]
    assert {t["name"] for t in picks["data"]} >= {"all tokens with A != 0"}
    assert all(" of " in m.value for m in at.metric[:3])
    at.segmented_control(key="cf_mode").set_value("At their parameters (defaults)").run()
    _ok(at, "Counterfactual")
    assert at.selectbox(key="cf_rule_a").value


def test_counterfactual_page_parameter_panel_moves_a_rule(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "counterfactual")
    at.segmented_control(key="cf_mode").set_value("At their parameters (defaults)").run()
    at.selectbox(key="cf_panel_rule").set_value("geo_mask").run()
    at.number_input(key="cf_panel_geo_mask_low").set_value(0.5).run()
    at.button(key="cf_panel_apply").click().run()
    _ok(at, "Counterfactual")
    assert at.session_state["rule_params"]["geo_mask"]["low"] == 0.5
    at.number_input(key="cf_panel_geo_mask_low").set_value(3.0).run()
    at.button(key="cf_panel_apply").click().run()
    assert any("geo_mask" in e.value and "low" in e.value and "3.0" in e.value for e in at.error)


def test_dashboard_rule_settings_reach_every_page(monkeypatch, logdir):
    """``trustscope dashboard --rule`` hands its settings to the pages: the rules are evaluated there."""
    monkeypatch.setenv("TRUSTSCOPE_RULE_SETTINGS", "geo_mask@0.5")
    at = _open(monkeypatch, logdir, "rules")
    _ok(at, "Rules side by side")
    assert any("(1 set)" in e.proto.label for e in at.get("expander"))
    assert not any("geo_mask" in w.value for w in at.warning)  # at 0.5 it is no longer out of calibration


def test_counterfactual_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "counterfactual")
    at.segmented_control(key="cf_mode").set_value("At their parameters (defaults)").run()
    _ok(at, "Counterfactual")
    rule_a, rule_b = at.selectbox(key="cf_rule_a").value, at.selectbox(key="cf_rule_b").value
    assert rule_b == ("ppo_clip" if rule_a == "dppo_binary_tv" else "dppo_binary_tv")
    assert all(" of " in m.value for m in at.metric[:2])
    tokens = at.dataframe[-1].value
    assert {"token_text", "blocked_by", "kept_by", "mu_bucket", "adv_sign", "pos"} <= set(tokens.columns)
    assert set(tokens["blocked_by"]) <= {rule_a, rule_b} and (tokens["blocked_by"] != tokens["kept_by"]).all()
    fig = json.loads(_charts(at)[0].proto.spec)
    assert {t["meta"]["rule"] for t in fig["data"]} == {rule_a, rule_b}
    assert sum(_array(t["y"]).sum() for t in fig["data"]) == len(tokens)


def test_clipped_tokens_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "clipped_tokens")
    _ok(at, "Clipped tokens")
    at.selectbox(key="clip_rule").set_value("grpo").run()
    _ok(at, "Clipped tokens")
    table = at.dataframe[0].value
    assert {"text", "n_blocked", "n_occurrences", "block_rate", "mean_mu", "mean_entropy"} <= set(table.columns)
    assert 1 <= len(table) <= 20 and table["block_rate"].is_monotonic_decreasing
    assert (table["n_occurrences"] >= 5).all()
    fig = json.loads(_charts(at)[0].proto.spec)
    assert "grpo blocks" in fig["layout"]["xaxis"]["title"]["text"]
    at.radio(key="clip_sign").set_value("A<0").run()
    _ok(at, "Clipped tokens")


def test_token_explorer_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "token_explorer")
    _ok(at, "Token explorer")
    body = at.get("html")[0].proto.body
    assert body.count('class="tok"') >= 1 and "&lt;- sampled" in body and "&#x27;" in body and " pi " in body
    run = at.selectbox(key="run_picker").value
    step = at.number_input(key="explorer_step").value
    assert step >= 0 and "blocked" in at.selectbox(key="explorer_sample").format_func(
        at.selectbox(key="explorer_sample").value)
    assert {"pos", "text", "mu", "pi", "ratio", "tv", "advantage", "blocked"} <= set(at.dataframe[0].value.columns)
    assert run
    at.radio(key="explorer_colour").set_value("blocked").run()
    _ok(at, "Token explorer")
    assert any(c.value.startswith("Red: the trainer's own rule") for c in at.main.caption)
    at.selectbox(key="explorer_rule").set_value("ppo_clip").run()
    _ok(at, "Token explorer")
    assert any(c.value.startswith("Red: ppo_clip blocks") for c in at.main.caption)


def test_token_explorer_opens_the_token_a_link_names(monkeypatch, logdir):
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)
    at.run()
    run = at.dataframe[0].value["run_id"].iloc[-1]
    at.switch_page("views/counterfactual.py")
    at.run()
    at.selectbox(key="run_picker").set_value(run).run()
    at.segmented_control(key="cf_mode").set_value("At their parameters (defaults)").run()
    tokens = at.dataframe[-1].value
    if tokens.empty:
        pytest.skip("the two default rules agree on every token of this log")
    row = tokens.iloc[0]
    at.session_state["explorer_target"] = {"run": run, "step": int(row["step"]), "sample": int(row["sample_id"]),
                                           "pos": int(row["pos"])}
    at.switch_page("views/token_explorer.py")
    at.run()
    _ok(at, "Token explorer")
    assert at.selectbox(key="run_picker").value == run
    assert at.number_input(key="explorer_step").value == int(row["step"])
    assert at.selectbox(key="explorer_sample").value == int(row["sample_id"])
    assert at.selectbox(key="explorer_topk_pos").value == int(row["pos"])


def test_drill_down_pages_open_on_the_runs_comparison_and_keep_what_was_picked(monkeypatch, logdir):
    at = _open(monkeypatch, logdir)
    table = at.dataframe[0].value
    first_group = at.multiselect(key="group_picker").value[0]
    at.switch_page("views/rules.py")
    at.run()
    assert at.selectbox(key="run_picker").value == table.loc[table["group"] == first_group, "run_id"].iloc[0]
    other = table["run_id"].iloc[-1]
    at.selectbox(key="run_picker").set_value(other).run()
    at.switch_page("views/token_explorer.py")
    at.run()
    assert at.selectbox(key="run_picker").value == other
    steps = at.number_input(key="explorer_step")
    picked = max(steps.min, steps.value - 1)
    steps.set_value(picked).run()
    sample = at.selectbox(key="explorer_sample").value
    at.switch_page("views/counterfactual.py")
    at.run()
    assert at.selectbox(key="run_picker").value == other
    at.switch_page("views/token_explorer.py")
    at.run()
    _ok(at, "Token explorer")
    assert at.number_input(key="explorer_step").value == picked
    assert at.selectbox(key="explorer_sample").value == sample


def test_the_run_the_dashboard_was_opened_for_comes_first(monkeypatch, logdir):
    """``trustscope demo`` names its run (TRUSTSCOPE_FOCUS_RUN): the Runs page compares it first and the
    drill-down pages open on it, whatever the default comparison would have put first."""
    from app.launch import FOCUS_ENV

    table = _open(monkeypatch, logdir).dataframe[0].value
    focus = table["run_id"].iloc[-1]
    monkeypatch.setenv(FOCUS_ENV, focus)
    at = _open(monkeypatch, logdir)
    group = table.loc[table["run_id"] == focus, "group"].iloc[0]
    picked = at.multiselect(key="group_picker").value
    assert picked[0] == group
    rules = table.drop_duplicates("group").set_index("group")["loss_rule"]
    if set(data.CONTRAST_RULES) & set(table["loss_rule"]):  # still beside the run without a trust region
        assert any(rules[g] in data.CONTRAST_RULES for g in picked), picked
    at.switch_page("views/rules.py")
    at.run()
    assert at.selectbox(key="run_picker").value == focus


def test_a_folders_newest_run_trained_apart_from_the_others_comes_first(monkeypatch):
    """``trustscope dashboard runs/demo``, the demo's run beside the shipped ones trained days before: the Runs page
    compares the newest run's configuration first and the drill-down pages open on it; runs of one sweep, minutes
    apart, keep the default comparison."""
    import pandas as pd

    from app.launch import FOCUS_ENV

    monkeypatch.delenv(FOCUS_ENV, raising=False)
    start = pd.Timestamp("2026-12-04T07:28", tz="UTC")
    shipped = pd.DataFrame({
        "run_id": ["ppo_clip-s0", "ppo_clip-s1", "pg_is-s0", "pg_is-s1", "grpo-s0", "grpo-s1"],
        "group": ["ppo_clip", "ppo_clip", "pg_is", "pg_is", "grpo", "grpo"],
        "loss_rule": ["ppo_clip", "ppo_clip", "pg_is", "pg_is", "grpo", "grpo"],
        "updated_at": [start + pd.Timedelta(minutes=3 * i) for i in range(6)]})
    assert data.focus_run(shipped) is None
    before = data.default_comparison(shipped, "group")
    assert before[0] == "ppo_clip"
    demo = pd.concat([shipped, pd.DataFrame({"run_id": ["demo"], "group": ["demo"], "loss_rule": ["dppo_binary_tv"],
                                             "updated_at": [start + pd.Timedelta(days=3)]})], ignore_index=True)
    assert data.focus_run(demo) == "demo" and data.default_run(demo) == "demo"
    picked = data.default_comparison(demo, "group")
    assert picked[0] == "demo" and "pg_is" in picked  # still beside the run without a trust region
    monkeypatch.setenv(FOCUS_ENV, "grpo-s1")  # the demo names its run: that one wins
    assert data.default_comparison(demo, "group")[0] == "grpo"


def test_the_server_prepares_what_the_first_page_reads(monkeypatch, logdir, tmp_path):
    """``app/serve.py`` computes the Runs page's reads while the server starts (:func:`app.data.prepare`): the page
    then opens from those caches, without computing the run table, the overview, the collapse warning's cause or
    the Doctor section again."""
    from app import serve
    from app.sections import doctor
    from trustscope import report
    from trustscope.explain import warning

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    assert serve.served_logdir(["serve.py", "run", "app/main.py", "--", "--logdir", str(logdir)]) == str(logdir)
    for read in (data.runs, data.overview, data._warning_causes, doctor.panel):
        read.clear()
    serve.preload((), str(logdir)).join(timeout=300)  # the server's own preparation, as it starts

    def computed_again(*args, **kwargs):
        raise AssertionError("the Runs page computed what the server prepared")

    monkeypatch.setattr(report, "run_table", computed_again)
    monkeypatch.setattr(warning, "warning_causes", computed_again)
    monkeypatch.setattr(doctor, "doctor_panel", computed_again)
    at = _open(monkeypatch, logdir)
    _ok(at, "Runs")
    assert data.prepare(logdir, then=(("doctor", doctor.panel_of),)) == [  # each read the cache's, named
        "runs", "overview", "default comparison", "collapse warning", "doctor"]
    doctor.panel.clear()  # the same page with the Doctor section not prepared computes it (and here, fails)
    at = _open(monkeypatch, logdir)
    assert any("computed what the server prepared" in e.message for e in at.exception)
    assert data.prepare(tmp_path / "missing") == []  # nothing to read: left for the page to say


def test_sql_console_page(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "sql_console")
    _ok(at, "SQL console")
    columns, rows = at.dataframe[0].value, at.dataframe[1].value
    assert {"column", "type"} == set(columns.columns) and "run_id" in set(columns["column"])
    assert at.selectbox(key="sql_view").options[0] != "bad_negative_updates_scan"
    assert not any(o.endswith(("_partials", "_scan", "_core")) for o in at.selectbox(key="sql_view").options)
    assert len(rows) >= 1
    assert len(at.get("download_button")) == 1
    at.text_area(key="sql_text").set_value("select count(*) as n from tokens").run()
    at.button(key="sql_run").click().run()
    _ok(at, "SQL console")
    assert int(at.dataframe[1].value["n"].iloc[0]) > 0


def test_sql_console_refuses_writes_with_a_message(monkeypatch, logdir):
    at = _open(monkeypatch, logdir, "sql_console")
    at.text_area(key="sql_text").set_value("copy tokens to '/tmp/out.csv'").run()
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert "refused" in at.error[0].value


# ---------------------------------------------------------------------------------------------- bad input


def _partial_run(root: Path) -> Path:
    run = root / "run-live"
    (run / "tokens").mkdir(parents=True)
    (run / runformat.MANIFEST).write_text(json.dumps({"run_id": "run-live", "schema_version": runformat.SCHEMA_VERSION,
                                                   "status": "running"}))
    (run / "tokens" / ".rank000-000000.parquet.tmp").write_bytes(b"PAR1 half a file")
    return root


def _corrupt_tokens(root: Path, logdir: Path) -> Path:
    from trustscope.synthetic import SyntheticConfig, generate_run

    generate_run(root, "broken", SyntheticConfig(tokens=500, steps=2, edge_cases=False))
    (root / "broken" / "tokens" / "rank000-999999.parquet").write_bytes(b"this is not parquet")
    return root


def _corrupt_manifest(root: Path, logdir: Path) -> Path:
    run = root / "bad-manifest"
    (run / "steps").mkdir(parents=True)
    (run / runformat.MANIFEST).write_text("{not json")
    return root


@pytest.mark.parametrize("page", ["runs", "sql_console"])
def test_empty_logdir_shows_a_message(monkeypatch, tmp_path, page):
    at = _open(monkeypatch, tmp_path, None if page == "runs" else page)
    assert not at.exception
    assert "holds no runs yet" in at.warning[0].value


def test_missing_logdir_shows_a_message(monkeypatch, tmp_path):
    at = _open(monkeypatch, tmp_path / "nowhere")
    assert not at.exception
    assert "does not exist" in at.warning[0].value


@pytest.mark.parametrize("page", ["runs", "live", "token_explorer"])
def test_partial_logdir_waits_for_the_first_step(monkeypatch, tmp_path, page):
    at = _open(monkeypatch, _partial_run(tmp_path), None if page == "runs" else page)
    assert not at.exception and not at.error
    assert any("first step" in i.value for i in at.info)


@pytest.mark.parametrize("make", [_corrupt_tokens, _corrupt_manifest], ids=["tokens", "manifest"])
@pytest.mark.parametrize("page", ["runs", "rules"])
def test_corrupt_logdir_shows_an_error_not_a_traceback(monkeypatch, tmp_path, logdir, make, page):
    at = _open(monkeypatch, make(tmp_path, logdir), None if page == "runs" else page)
    assert not at.exception
    assert len(at.error) == 1
    message = at.error[0].value
    run = "broken" if make is _corrupt_tokens else "bad-manifest"
    assert f"Could not read all of run `{run}`" in message and "trustscope validate" in message
    assert ("rank000-999999.parquet: not a readable Parquet file" if make is _corrupt_tokens
            else "unreadable run.json") in message


# ---------------------------------------------------------------------------------------------- the page table


def test_the_page_table_lists_every_view_once_and_the_docs_show_it():
    from app.pages import PAGES, VIEWS, markdown_table

    files = [p.file for p in PAGES]
    assert sorted(files) == sorted(p.name for p in VIEWS.glob("*.py") if p.stem != "__init__")
    assert len(set(files)) == len(files) and [p.default for p in PAGES].count(True) == 1
    assert markdown_table() in (ROOT / "docs" / "architecture.md").read_text(), \
        "docs/architecture.md's page table differs from app/pages.py: paste app.pages.markdown_table()"


def test_every_page_of_the_table_is_in_the_menu(monkeypatch, logdir):
    from app.pages import PAGES

    at = _open(monkeypatch, logdir)
    for shown in PAGES[1:]:
        at.switch_page(shown.script)
        at.run()
        _ok(at, shown.title)


# ---------------------------------------------------------------------------------------------- the command


def test_dashboard_command_refuses_a_missing_logdir(tmp_path):
    from typer.testing import CliRunner

    from trustscope.cli import app

    result = CliRunner().invoke(app, ["dashboard", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "nowhere" in result.output


def test_dashboard_command_line_binds_localhost_and_passes_the_logdir(tmp_path):
    from app.launch import MAIN, SERVE, default_logdir, streamlit_command

    cmd = streamlit_command(tmp_path, port=8765)
    assert cmd[1:4] == [str(SERVE), "run", str(MAIN)]
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[-3:] == ["--", "--logdir", str(tmp_path)]
    assert streamlit_command(tmp_path, host="0.0.0.0")[cmd.index("--server.address") + 1] == "0.0.0.0"
    assert default_logdir() == SAMPLE_LOGS


def test_rules_picker_offers_a_rule_loaded_from_outside_the_repo(monkeypatch, tmp_path):
    """A user's rule, registered in a module outside the repo and named in $TRUSTSCOPE_RULES, is in the picker."""
    from trustscope import losses
    from trustscope.db import RULES_ENV
    from trustscope.synthetic import SyntheticConfig, generate_run

    (tmp_path / "ts_app_rules.py").write_text(
        "from trustscope.losses import RATIO_BAND, register_loss, token_mis\n"
        "register_loss('app_tight_band', sql=RATIO_BAND, low=0.97, high=1.03)(token_mis)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(RULES_ENV, "ts_app_rules")
    generate_run(tmp_path / "logs", "run", SyntheticConfig(tokens=3_000, steps=2, mean_length=20, seed=5))
    try:
        at = _open(monkeypatch, tmp_path / "logs", "rules")
        _ok(at, "Rules side by side")
        assert "app_tight_band" in at.multiselect(key="rules_picker").options
    finally:
        losses._REGISTRY.pop("app_tight_band", None)


@pytest.fixture(scope="module")
def async_logdir(tmp_path_factory) -> Path:
    from async_logs import write_async_logdir

    return write_async_logdir(tmp_path_factory.mktemp("async"))


def test_mismatch_where_page(monkeypatch, async_logdir):
    at = _open(monkeypatch, async_logdir, "mismatch_where")
    at.selectbox(key="run_picker").set_value("async-lag3").run()
    at.multiselect(key="mismatch_runs").set_value(["async-lag1", "sync-single-turn"]).run()
    _ok(at, "Where the mismatch lives")
    from trustscope.columns import DIMENSIONS

    assert [t.label for t in at.tabs] == [f"By {d.name}" for d in DIMENSIONS]  # routing: no row on a dense run
    charts = [json.loads(c.proto.spec) for c in _charts(at)]
    assert len(charts) == 6  # mismatch and ESS, then blocked fractions, for each dimension
    by_staleness = charts[4]
    lines = {t["name"] for t in by_staleness["data"]}
    assert lines == {"async-lag3", "async-lag1"}  # the run without versions says so instead
    lag3 = next(t for t in by_staleness["data"] if t["name"] == "async-lag3" and t["xaxis"] == "x")
    assert list(lag3["x"]) == ["0", "1", "2", "3"] and np.all(np.diff(_array(lag3["y"])) > 0)  # grows with staleness
    infos = [i.value for i in at.info]
    assert any("sync-single-turn logs no turn" in v for v in infos)
    assert any("sync-single-turn logs no policy_version" in v for v in infos)
    tables = [d.value for d in at.dataframe]
    assert len(tables) == 3 and {"tokens", "position"} - set(tables[0].columns) == {"tokens"}
    assert tables[0]["run_id"].nunique() == 3  # every run has position buckets
    rule = at.multiselect(key="mismatch_rules").value[0]
    assert tables[2][rule].str.contains(r"% \(\d[\d,]* of \d[\d,]*\)").all()  # a count beside every fraction


def test_mismatch_where_page_says_when_no_run_has_dimensions(monkeypatch, legacy_logs):
    """A run logged before the summary dimensions (tests/data/legacy): the page says so and draws nothing."""
    at = _open(monkeypatch, legacy_logs, "mismatch_where")
    _ok(at, "Where the mismatch lives")
    assert not _charts(at) and "no summary dimensions (logged before them" in at.info[0].value


def test_mismatch_where_page_says_a_run_logs_the_engines_experts_alone(monkeypatch, tmp_path):
    """An import that carries the engine's routed experts only (no trainer side): the routing section says which
    side and on how many rows, and draws nothing; the import's position and turn charts come from its token rows
    (it logs every token and no summaries)."""
    from test_importers_slime import routed_dump

    from trustscope.importers import import_run

    routed_dump(tmp_path / "dump")
    import_run("slime", tmp_path / "dump", tmp_path / "logs", run_id="engine-only")
    at = _open(monkeypatch, tmp_path / "logs", "mismatch_where")
    _ok(at, "Where the mismatch lives")
    # slime's weight_versions give the import a policy version, so staleness is charted beside position and turn
    assert sorted(c.key for c in _charts(at)) == ["blocked_position", "blocked_staleness", "blocked_turn",
                                                   "mismatch_position", "mismatch_staleness", "mismatch_turn"]
    assert any("Run engine-only logs the engine's routed experts alone (115 token rows)" in i.value for i in at.info)


def test_mismatch_where_page_shows_routing_replays_replace_rate(monkeypatch, tmp_path):
    """A replayed MoE run that logs the router's own pick (router_experts) gets its replace rate, overall and per
    MoE layer in layer order, beside a run without one (not listed); the numbers are the recount from the lists."""
    from test_routing_storage import perturbed, random_routing, step_tokens

    from trustscope.logger import TokenLogger

    shape = (12, 2, 8)  # 12 MoE layers: "layer 10" sorts before "layer 2" as text
    rng = np.random.default_rng(7)
    recount = []
    for run, replay in (("replayed", True), ("plain", False)):
        with TokenLogger(tmp_path / "logs", run, routing_shape=shape, routing_replay=replay,
                         loss_rule="ppo_clip") as logger:
            for step in range(2):
                tokens = step_tokens(rng, 8, 16)
                engine = random_routing(rng, (8, 16), shape)
                if replay:  # the forward used the engine's experts; the router's own pick differs on ~10%
                    router = perturbed(rng, engine, 0.1, shape[2])
                    tokens |= {"engine_experts": engine, "trainer_experts": engine, "router_experts": router}
                    recount.append((engine[..., :, None] == router[..., None, :]).any(-1))  # (B, T, L, k)
                else:
                    tokens |= {"engine_experts": engine, "trainer_experts": perturbed(rng, engine, 0.05, shape[2])}
                logger.log_step(step, tokens=tokens, samples={"reward": rng.random(8)}, scalars={"loss": 0.1})
    kept = np.concatenate(recount)  # the router's own choices the replay kept
    at = _open(monkeypatch, tmp_path / "logs", "mismatch_where")
    _ok(at, "Where the mismatch lives")
    agreement, table = (d.value for d in at.dataframe if "all" in d.value.columns)  # agreement, then replace rate
    assert agreement["run_id"].tolist() == ["plain", "replayed"]
    assert table["run_id"].tolist() == ["replayed"]  # the run without router_experts is not listed
    assert list(table.columns) == ["run_id", "tokens", "all", *[f"layer {i}" for i in range(shape[0])]]
    assert table["all"].iloc[0] == pytest.approx(1 - kept.mean(), abs=1e-6)
    for layer in range(shape[0]):
        assert table[f"layer {layer}"].iloc[0] == pytest.approx(1 - kept[:, :, layer].mean(), abs=1e-6)
    assert any("replace rate" in c.value for c in at.caption)


def test_no_page_script_shows_a_stray_string():
    """Streamlit's magic writes every bare expression of a page script to the page: a docstring-like string under a
    module-level name (``X = ...`` then ``\"\"\"what X is\"\"\"``) would appear above the page's title. Only the
    module docstring may stand alone."""
    import ast

    views = Path(__file__).resolve().parent.parent / "app" / "views"
    stray = []
    for path in sorted(views.glob("*.py")):
        body = ast.parse(path.read_text()).body
        for node in body[1:]:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                stray.append(f"{path.name}:{node.lineno}")
    assert not stray, f"bare strings a page would show: {stray}"
