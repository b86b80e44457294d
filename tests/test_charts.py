"""The figure builders shared by the dashboard and the report: traces, axes and values from small hand-made frames,
and the conventions every chart follows (rule colours, {1, 2, 5} x 10^k log ticks, percentages from 0)."""

import math

import pandas as pd
import pytest

from trustscope import figures
from trustscope.losses import list_losses

STEPS = pd.DataFrame({
    "run_id": ["a", "a", "b", "b", "a", "b"],
    "step": [0, 1, 0, 1, 0, 0],
    "name": ["reward", "reward", "reward", "reward", "mismatch", "mismatch"],
    "value": [0.1, 0.5, 0.2, 0.3, 0.003, 0.004],
})


def _mantissa_ok(label: str) -> bool:
    value = float(label)
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


# ------------------------------------------------------------------------------------------------ conventions


def test_log_ticks_are_1_2_5_times_a_power_of_ten_and_cover_the_data():
    ticks = figures.log_ticks(0.0031, 0.93)
    assert ticks == pytest.approx([0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
    assert figures.log_ticks(0.0031, 9.3) == pytest.approx([0.001, 0.01, 0.1, 1.0, 10.0])
    assert figures.log_ticks(1e-9, 0.5) == pytest.approx([10.0 ** k for k in range(-9, 1)])  # > 3 decades
    assert len(figures.log_ticks(0.9, 0.9)) >= 2
    with pytest.raises(ValueError, match="positive finite"):
        figures.log_ticks(0.0, 1.0)


def test_number_labels_never_use_si_prefixes_and_read_as_numbers():
    assert [figures.number_label(v) for v in (0.9, 0.002, 20.0, 2e-5, 1e-7, 5e5)] == [
        "0.9", "0.002", "20", "2e-5", "1e-7", "5e5"]
    assert all(_mantissa_ok(figures.number_label(t)) for t in figures.log_ticks(1.5e-7, 3e4))


def test_log_axis_sets_array_ticks_and_range():
    fig = figures.ratio_vs_divergence(pd.DataFrame({"mu": [1e-4, 0.9], "ratio": [100.0, 0.5], "tv": [1e-5, 0.18],
                                                    "mu_bucket": ["1: <0.001", "6: >=0.9"]}))
    axis = fig.layout.yaxis
    assert axis.type == "log" and axis.tickmode == "array"
    assert all(_mantissa_ok(t) for t in axis.ticktext) and "0.5" in axis.ticktext and "100" in axis.ticktext
    assert axis.range[0] == pytest.approx(math.log10(0.5)) and axis.range[1] == pytest.approx(2.0)


def test_every_rule_has_one_colour_in_registry_order():
    rules = list_losses()
    colours = [figures.rule_colour(r) for r in rules]
    assert len(set(colours)) == len(rules)  # distinct while the palette lasts
    assert figures.rule_order(["ppo_clip", "cispo", "mine"]) == ["cispo", "ppo_clip", "mine"]
    assert figures.rule_colour("mine") == figures.rule_colour("mine")


def test_has_data():
    assert not figures.has_data(figures.empty_figure("nothing"))
    assert figures.has_data(figures.metrics_over_steps(STEPS, ["reward"]))


# ------------------------------------------------------------------------------------------------ over steps


def test_metrics_over_steps_one_panel_per_metric_one_line_per_run():
    fig = figures.metrics_over_steps(STEPS, ["reward", "mismatch"], {"reward": "mean reward"})
    assert len(fig.data) == 4  # 2 metrics x 2 runs
    reward_a = fig.data[0]
    assert reward_a.name == "a" and list(reward_a.x) == [0, 1] and list(reward_a.y) == [0.1, 0.5]
    assert fig.data[1].name == "b" and list(fig.data[1].y) == [0.2, 0.3]
    assert [t.showlegend for t in fig.data] == [True, True, False, False]
    assert fig.data[2].yaxis == "y2" and list(fig.data[2].y) == [0.003]
    assert fig.layout.yaxis.title.text == "mean reward"
    assert fig.layout.yaxis2.type == "log" and fig.layout.yaxis2.ticktext == ("0.002", "0.005")
    assert fig.layout.xaxis2.title.text == "step" and fig.layout.xaxis2.dtick == 1  # integer steps


def test_metrics_over_steps_keeps_a_panel_for_a_missing_metric():
    fig = figures.metrics_over_steps(STEPS, ["reward", "entropy"])
    entropy = [t for t in fig.data if t.yaxis == "y2"]
    assert len(entropy) == 2 and all(len(t.x) == 0 for t in entropy)


def test_seed_band_is_the_mean_with_min_max_and_draws_a_band():
    df = pd.DataFrame({"run_id": ["a-s0", "a-s1", "a-s0", "a-s1"], "step": [0, 0, 1, 1], "name": "reward",
                       "value": [0.2, 0.4, 0.5, 0.7]})
    band = figures.seed_band(df, {"a-s0": "a", "a-s1": "a"})
    assert band["value"].tolist() == pytest.approx([0.3, 0.6]) and band["lo"].tolist() == [0.2, 0.5]
    assert band["n_runs"].tolist() == [2, 2]
    fig = figures.metrics_over_steps(band, ["reward"])
    assert fig.data[0].fill == "toself" and fig.data[1].name == "a"


def test_smooth_is_an_ema_per_group():
    df = pd.DataFrame({"run_id": ["a"] * 3 + ["b"], "step": [0, 1, 2, 0], "value": [0.0, 1.0, 1.0, 5.0]})
    out = figures.smooth(df, 0.5, ["run_id"])
    assert out[out.run_id == "b"]["value"].tolist() == [5.0]
    assert out[out.run_id == "a"]["value"].iloc[1] == pytest.approx(2 / 3)  # adjusted ewm, alpha 0.5
    assert figures.smooth(df, 0.0, ["run_id"]) is df
    with pytest.raises(ValueError, match="smoothing weight"):
        figures.smooth(df, 1.0, ["run_id"])


def test_missing_column_names_the_chart_and_the_column():
    with pytest.raises(ValueError, match=r"metrics_over_steps: missing column\(s\) \['value'\]"):
        figures.metrics_over_steps(STEPS.drop(columns="value"), ["reward"])


def test_blocked_fraction_by_rule_panels_per_run_marks_the_applied_rule():
    df = pd.DataFrame({"run_id": ["a", "a", "b", "b"], "step": [1, 0, 0, 0],
                       "rule": ["grpo", "grpo", "grpo", "ppo_clip"], "blocked_frac": [0.2, 0.1, 0.05, 0.01],
                       "n_blocked": [2, 1, 1, 0], "n_tokens": [10, 10, 20, 20]})
    fig = figures.blocked_fraction_by_rule(df, applied={"a": "grpo", "b": "ppo_clip"})
    assert [t.name for t in fig.data] == ["grpo", "grpo", "ppo_clip"]
    assert list(fig.data[0].x) == [0, 1] and list(fig.data[0].y) == [0.1, 0.2]  # sorted by step
    assert fig.data[0].line.width > fig.data[1].line.width  # a applied grpo, b did not
    assert fig.data[0].line.color == fig.data[1].line.color == figures.rule_colour("grpo")
    assert [t.showlegend for t in fig.data] == [True, False, True]
    assert fig.data[0].meta == {"rule": "grpo"} and "of %{customdata[1]" in fig.data[0].hovertemplate
    assert fig.layout.yaxis.tickformat.endswith("%") and fig.layout.yaxis.rangemode == "tozero"
    assert "applied: grpo" in fig.layout.annotations[0].text


def test_bad_updates_vs_reward_two_axes_and_warning_line():
    df = pd.DataFrame({"step": [1, 0], "bad_rate": [0.004, 0.001], "reward_fluctuation": [0.2, 0.0]})
    fig = figures.bad_updates_vs_reward(df, alert_line=0.005, alert_steps=[1])
    assert list(fig.data[0].x) == [0, 1] and list(fig.data[0].y) == [0.001, 0.004]
    assert fig.data[1].yaxis == "y2" and list(fig.data[1].y) == [0.0, 0.2]
    assert fig.layout.yaxis2.title.text == "|reward - previous step's reward|"
    assert fig.layout.yaxis.tickformat.endswith("%") and len(fig.layout.shapes) == 2


# ------------------------------------------------------------------------------------------------ trust region


def test_ratio_vs_divergence_is_figure_2():
    df = pd.DataFrame({"mu": [1e-4, 2e-4, 0.9], "ratio": [100.0, 0.5, 0.8], "tv": [0.0099, 1e-4, 0.18],
                       "mu_bucket": ["<0.001", "<0.001", ">=0.9"]})
    fig = figures.ratio_vs_divergence(df, "tv", bucket_order=[">=0.9", "<0.001"])
    assert [t.name for t in fig.data] == [">=0.9", ">=0.9", "<0.001", "<0.001"]  # bucket order respected
    assert list(fig.data[2].y) == [100.0, 0.5] and list(fig.data[3].y) == [0.0099, 1e-4]
    assert fig.data[2].xaxis == "x" and fig.data[3].xaxis == "x2"
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    assert fig.layout.yaxis.title.text == "ratio pi / mu"
    assert fig.layout.yaxis2.title.text == "binary TV |pi - mu|"
    assert fig.layout.xaxis.title.text.startswith("mu")


def test_ratio_divergence_histogram_sizes_by_count_and_sorts_buckets():
    df = pd.DataFrame({"mu_bucket": ["6: >=0.9", "1: <0.001", "1: <0.001"], "ratio": [0.9, 50.0, 0.02],
                       "divergence": [0.1, 1e-4, 1e-4], "n": [100, 25, 1]})
    fig = figures.ratio_divergence_histogram(df, "binary_tv")
    assert [t.name for t in fig.data] == ["1: <0.001", "6: >=0.9"]
    low = fig.data[0]
    assert list(low.y) == [50.0, 0.02] and list(low.customdata) == [25, 1]
    assert list(low.marker.size) == pytest.approx([4 + 26 * 0.5, 4 + 26 * 0.1])
    assert fig.data[1].marker.size[0] == pytest.approx(30.0)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.title.text.startswith("binary TV")
    assert fig.layout.yaxis.title.text.startswith("ratio pi / mu")


def test_spread_by_bucket_orders_buckets_and_shows_counts():
    df = pd.DataFrame({"mu_bucket": ["b", "a"], "ratio_dev": [0.1, 5.0], "tv": [0.2, 0.01], "n_tokens": [3, 1200]})
    fig = figures.spread_by_bucket(df, ["a", "b"])
    assert list(fig.data[0].x) == ["a<br>(1,200 tokens)", "b<br>(3 tokens)"] and list(fig.data[0].y) == [5.0, 0.1]
    assert list(fig.data[1].y) == [0.01, 0.2] and fig.layout.yaxis.type == "log"


def test_rules_by_bucket_one_panel_per_sign_one_bar_per_rule():
    df = pd.DataFrame({
        "rule": ["grpo", "grpo", "dppo_binary_tv", "dppo_binary_tv"],
        "mu_bucket": ["low", "high", "low", "high"],
        "adv_sign": ["A>0", "A>0", "A<0", "A<0"],
        "blocked_frac": [0.3, 0.01, 0.02, 0.2], "n_blocked": [3, 1, 1, 4], "n_tokens": [10, 100, 50, 20],
    })
    fig = figures.rules_by_bucket(df, ["low", "high"], applied="grpo")
    assert [a.text for a in fig.layout.annotations] == ["advantage A>0", "advantage A<0"]
    dppo_neg = fig.data[1]  # registry order: dppo_binary_tv before grpo
    assert dppo_neg.name == "dppo_binary_tv" and dppo_neg.xaxis == "x2" and list(dppo_neg.y) == [0.02, 0.2]
    grpo_pos = fig.data[2]
    assert grpo_pos.name == "grpo" + figures.APPLIED_MARK and list(grpo_pos.y) == [0.3, 0.01]
    assert grpo_pos.customdata.tolist() == [[3, 10], [1, 100]]
    assert fig.layout.barmode == "group" and fig.layout.yaxis.rangemode == "tozero"
    assert list(fig.data[0].x) == list(fig.data[1].x) == ["low", "high"]  # every bucket on both panels


def test_counterfactual_by_bucket_counts_on_an_integer_axis():
    df = pd.DataFrame({"mu_bucket": ["low", "high"], "adv_sign": ["A<0", "A<0"], "only_a": [2, 0],
                       "only_b": [1, 3]})
    fig = figures.counterfactual_by_bucket(df, "ppo_clip", "dppo_binary_tv")
    assert [t.name for t in fig.data] == ["ppo_clip blocks, dppo_binary_tv keeps",
                                          "dppo_binary_tv blocks, ppo_clip keeps"]
    assert list(fig.data[0].y) == [0, 2] and fig.data[0].marker.color == figures.rule_colour("ppo_clip")
    assert fig.layout.yaxis.tickformat == ",d" and fig.layout.yaxis.dtick == 1


def test_clipped_tokens_ranked_by_rate_with_counts():
    df = pd.DataFrame({"text": ["Wait", "=", "\n"], "block_rate": [0.9, 0.5, 0.1], "n_blocked": [9, 50, 10],
                       "n_occurrences": [10, 100, 100], "mean_mu": [0.05, 0.1, 0.5], "mean_entropy": [2.5, 1.8, 0.3]})
    fig = figures.clipped_tokens(df, "grpo")
    bar = fig.data[0]
    assert list(bar.x) == [0.1, 0.5, 0.9] and list(bar.y) == ["\\n", "=", "Wait"]  # highest rate on top
    assert list(bar.text) == ["10 of 100", "50 of 100", "9 of 10"]
    assert fig.layout.xaxis.tickformat.endswith("%") and "grpo" in fig.layout.xaxis.title.text
    spaced = figures.clipped_tokens(df.assign(text=[" ", " the", "\t"]), "grpo").data[0]
    assert list(spaced.y) == ["\\t", "\u2423the", "\u2423"]  # no blank label


# ------------------------------------------------------------------------------------------------ tokens


def test_token_colour_scales():
    assert figures.token_colour(1.0, "ratio") == "rgb(255,255,255)"
    assert figures.token_colour(4.0, "ratio") == "rgb(228,87,86)"
    assert figures.token_colour(0.25, "ratio") == "rgb(76,120,168)"
    assert figures.token_colour(100.0, "ratio") == "rgb(228,87,86)"  # clamped
    assert figures.token_colour(0.0, "tv") == "rgb(255,255,255)"
    assert figures.token_colour(-2.0, "advantage") == "rgb(76,120,168)"
    assert figures.token_colour(-0.5, "advantage", scale=0.5) == "rgb(76,120,168)"  # scale fitted to the data
    assert figures.token_colour(True, "blocked") != figures.token_colour(False, "blocked")
    assert figures.token_colour(math.nan, "tv") == "rgb(235,235,235)"
    with pytest.raises(ValueError, match="colour_by must be one of"):
        figures.token_colour(1.0, "entropy")


def test_token_spans_html_escapes_and_carries_alternatives():
    df = pd.DataFrame({"pos": [1, 0], "text": ["<b>", "x"], "ratio": [4.0, 1.0], "tv": [0.1, 0.0],
                       "advantage": [0.5, 0.5], "blocked": [True, False], "mu": [0.1, 0.9], "pi": [0.4, 0.9],
                       "alternatives": ["'<b>' mu 0.1000 <- sampled\n'a' mu 0.05", "'x' mu 0.9000 <- sampled"]})
    out = figures.token_spans_html(df, "ratio")
    assert out.count('class="tok"') == 2
    assert out.index(">x</span>") < out.index("&lt;b&gt;</span>")  # ordered by pos
    assert "<b>" not in out.replace("&lt;b&gt;", "")
    assert "rgb(228,87,86)" in out  # ratio 4 is full red
    assert "&#x27;a&#x27; mu 0.05" in out and "blocked" in out and "pi 0.4000" in out


def test_format_alternatives_marks_the_sampled_token_and_shows_pi():
    text = figures.format_alternatives(["Thus", "So"], [0.6, 0.3], sampled_index=1, pi_probs=[0.5, 0.45])
    assert text == "'Thus' mu 0.6000  pi 0.5000\n'So' mu 0.3000  pi 0.4500 <- sampled"
    assert figures.format_alternatives(["a"], [1.0], None) == "'a' mu 1.0000"


def test_empty_figure_carries_message():
    fig = figures.empty_figure("no rows")
    assert fig.layout.annotations[0].text == "no rows" and len(fig.data) == 0


def test_charts_by_dimension_order_buckets_by_value_and_carry_counts():
    from trustscope.figures import blocked_by_dimension, mismatch_by_dimension

    labels = {0: "0", 1: "1", 2: "2-3", 16: "16-31", 4: "4-7", 8: "8-15"}
    rows = pd.DataFrame([{"run_id": run, "bucket": b, "bucket_label": label, "n_tokens": 10 * (b + 1),
                          "mismatch_mean": 0.01 * (b + 1), "ess_frac": 0.9} for run in ("a", "b")
                         for b, label in labels.items()])
    fig = mismatch_by_dimension(rows, "position")
    assert list(fig.layout.xaxis.categoryarray) == ["0", "1", "2-3", "4-7", "8-15", "16-31"]
    first = fig.data[0]
    assert list(first.x) == ["0", "1", "2-3", "4-7", "8-15", "16-31"] and first.customdata[-1][0] == 170
    assert {t.name for t in fig.data} == {"a", "b"} and fig.layout.yaxis2.tickformat == ".2~%"
    stale = pd.DataFrame([{"run_id": "a", "rule": rule, "bucket": b, "bucket_label": str(b), "n_blocked": b,
                           "n_nonzero_advantage": 20, "blocked_frac": b / 20} for rule in ("ppo_clip", "grpo")
                          for b in (10, 9, 2)])
    fig = blocked_by_dimension(stale, "staleness")
    assert [a.text for a in fig.layout.annotations] == [r for r in list_losses() if r in ("ppo_clip", "grpo")]
    assert list(fig.layout.xaxis.categoryarray) == ["2", "9", "10"]
    assert list(fig.data[0].customdata[:, 0]) == [2, 9, 10] and "of %{customdata[1]" in fig.data[0].hovertemplate
