"""The dashboard's figure builders: traces, axis titles and values, from small hand-made frames."""

import math

import pandas as pd
import pytest

from app import charts

STEPS = pd.DataFrame({
    "run_id": ["a", "a", "b", "b", "a", "b"],
    "step": [0, 1, 0, 1, 0, 0],
    "name": ["reward", "reward", "reward", "reward", "mismatch", "mismatch"],
    "value": [0.1, 0.5, 0.2, 0.3, 0.003, 0.004],
})


def test_metrics_over_steps_one_panel_per_metric_one_line_per_run():
    fig = charts.metrics_over_steps(STEPS, ["reward", "mismatch"], {"reward": "mean reward"})
    assert len(fig.data) == 4  # 2 metrics x 2 runs
    reward_a = fig.data[0]
    assert reward_a.name == "a" and list(reward_a.x) == [0, 1] and list(reward_a.y) == [0.1, 0.5]
    assert fig.data[1].name == "b" and list(fig.data[1].y) == [0.2, 0.3]
    assert [t.showlegend for t in fig.data] == [True, True, False, False]
    assert fig.data[2].yaxis == "y2" and list(fig.data[2].y) == [0.003]
    assert fig.layout.yaxis.title.text == "mean reward"
    assert fig.layout.yaxis2.title.text == "mismatch"
    assert fig.layout.xaxis2.title.text == "step"


def test_metrics_over_steps_keeps_a_panel_for_a_missing_metric():
    fig = charts.metrics_over_steps(STEPS, ["reward", "entropy"])
    entropy = [t for t in fig.data if t.yaxis == "y2"]
    assert len(entropy) == 2 and all(len(t.x) == 0 for t in entropy)


def test_missing_column_names_the_chart_and_the_column():
    with pytest.raises(ValueError, match=r"metrics_over_steps: missing column\(s\) \['value'\]"):
        charts.metrics_over_steps(STEPS.drop(columns="value"), ["reward"])


def test_blocked_fraction_by_rule_panels_per_run():
    df = pd.DataFrame({"run_id": ["a", "a", "b"], "step": [1, 0, 0], "rule": ["grpo", "grpo", "grpo"],
                       "blocked_frac": [0.2, 0.1, 0.05]})
    fig = charts.blocked_fraction_by_rule(df)
    assert [t.name for t in fig.data] == ["grpo", "grpo"]
    assert list(fig.data[0].x) == [0, 1] and list(fig.data[0].y) == [0.1, 0.2]  # sorted by step
    assert fig.data[1].xaxis == "x2" and list(fig.data[1].y) == [0.05]
    assert fig.layout.yaxis.title.text == "blocked fraction"
    assert [a.text for a in fig.layout.annotations] == ["a", "b"]


def test_ratio_vs_divergence_is_figure_2():
    df = pd.DataFrame({"mu": [1e-4, 2e-4, 0.9], "ratio": [100.0, 0.5, 0.8], "tv": [0.0099, 1e-4, 0.18],
                       "mu_bucket": ["<0.001", "<0.001", ">=0.9"]})
    fig = charts.ratio_vs_divergence(df, "tv", bucket_order=[">=0.9", "<0.001"])
    assert [t.name for t in fig.data] == [">=0.9", ">=0.9", "<0.001", "<0.001"]  # bucket order respected
    assert list(fig.data[2].y) == [100.0, 0.5] and list(fig.data[3].y) == [0.0099, 1e-4]
    assert fig.data[2].xaxis == "x" and fig.data[3].xaxis == "x2"
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert fig.layout.yaxis.title.text == "ratio pi / mu"
    assert fig.layout.yaxis2.title.text == "binary TV |pi - mu|"
    assert fig.layout.xaxis.title.text.startswith("mu")


def test_ratio_divergence_histogram_sizes_by_count_and_sorts_buckets():
    df = pd.DataFrame({"mu_bucket": ["6: >=0.9", "1: <0.001", "1: <0.001"], "ratio": [0.9, 50.0, 0.02],
                       "divergence": [0.1, 1e-4, 1e-4], "n": [100, 25, 1]})
    fig = charts.ratio_divergence_histogram(df, "binary_tv")
    assert [t.name for t in fig.data] == ["1: <0.001", "6: >=0.9"]
    low = fig.data[0]
    assert list(low.y) == [50.0, 0.02] and list(low.customdata) == [25, 1]
    assert list(low.marker.size) == pytest.approx([4 + 26 * 0.5, 4 + 26 * 0.1])
    assert fig.data[1].marker.size[0] == pytest.approx(30.0)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.title.text == "binary tv"
    assert fig.layout.yaxis.title.text == "ratio pi / mu"


def test_spread_by_bucket_orders_buckets():
    df = pd.DataFrame({"mu_bucket": ["b", "a"], "ratio_dev": [0.1, 5.0], "tv": [0.2, 0.01]})
    fig = charts.spread_by_bucket(df, ["a", "b"])
    assert list(fig.data[0].x) == ["a", "b"] and list(fig.data[0].y) == [5.0, 0.1]
    assert list(fig.data[1].y) == [0.01, 0.2]


def test_rules_by_bucket_one_panel_per_sign_one_bar_per_rule():
    df = pd.DataFrame({
        "rule": ["grpo", "grpo", "dppo_binary_tv", "dppo_binary_tv"],
        "mu_bucket": ["low", "high", "low", "high"],
        "adv_sign": ["A>0", "A>0", "A<=0", "A<=0"],
        "blocked_frac": [0.3, 0.01, 0.02, 0.2],
    })
    fig = charts.rules_by_bucket(df, ["low", "high"])
    assert [a.text for a in fig.layout.annotations] == ["advantage A>0", "advantage A<=0"]
    grpo_pos = fig.data[0]
    assert grpo_pos.name == "grpo" and list(grpo_pos.x) == ["low", "high"] and list(grpo_pos.y) == [0.3, 0.01]
    dppo_neg = fig.data[3]
    assert dppo_neg.name == "dppo_binary_tv" and dppo_neg.xaxis == "x2" and list(dppo_neg.y) == [0.02, 0.2]
    assert fig.layout.barmode == "group"


def test_clipped_tokens_bar_sorted_with_probability_colour():
    df = pd.DataFrame({"text": ["Wait", "=", "\n"], "n_blocked": [30, 50, 10], "mean_mu": [0.05, 0.1, 0.5],
                       "mean_entropy": [2.5, 1.8, 0.3]})
    fig = charts.clipped_tokens(df, "grpo")
    bar = fig.data[0]
    assert list(bar.x) == [10, 30, 50] and list(bar.y) == ["\\n", "Wait", "="]
    assert list(bar.marker.color) == [0.5, 0.05, 0.1]
    assert bar.customdata[1].tolist() == [0.05, 2.5]
    assert fig.layout.xaxis.title.text == "tokens blocked by grpo"


def test_bad_updates_vs_reward_two_axes():
    df = pd.DataFrame({"step": [1, 0], "bad_rate": [0.004, 0.001], "reward_fluctuation": [0.2, 0.0]})
    fig = charts.bad_updates_vs_reward(df)
    assert list(fig.data[0].x) == [0, 1] and list(fig.data[0].y) == [0.001, 0.004]
    assert fig.data[1].yaxis == "y2" and list(fig.data[1].y) == [0.0, 0.2]
    assert fig.layout.yaxis2.title.text == "|reward - previous reward|"


def test_token_colour_scales():
    assert charts.token_colour(1.0, "ratio") == "rgb(255,255,255)"
    assert charts.token_colour(4.0, "ratio") == "rgb(228,87,86)"
    assert charts.token_colour(0.25, "ratio") == "rgb(76,120,168)"
    assert charts.token_colour(100.0, "ratio") == "rgb(228,87,86)"  # clamped
    assert charts.token_colour(0.0, "tv") == "rgb(255,255,255)"
    assert charts.token_colour(-2.0, "advantage") == "rgb(76,120,168)"
    assert charts.token_colour(True, "blocked") != charts.token_colour(False, "blocked")
    assert charts.token_colour(math.nan, "tv") == "rgb(235,235,235)"
    with pytest.raises(ValueError, match="colour_by must be one of"):
        charts.token_colour(1.0, "entropy")


def test_token_spans_html_escapes_and_carries_alternatives():
    df = pd.DataFrame({"pos": [1, 0], "text": ["<b>", "x"], "ratio": [4.0, 1.0], "tv": [0.1, 0.0],
                       "advantage": [0.5, 0.5], "blocked": [True, False], "mu": [0.1, 0.9],
                       "alternatives": ["'<b>' 0.1000 <- sampled\n'a' 0.05", "'x' 0.9000 <- sampled"]})
    out = charts.token_spans_html(df, "ratio")
    assert out.count('class="tok"') == 2
    assert out.index(">x</span>") < out.index("&lt;b&gt;</span>")  # ordered by pos
    assert "<b>" not in out.replace("&lt;b&gt;", "")
    assert "rgb(228,87,86)" in out  # ratio 4 is full red
    assert "&#x27;a&#x27; 0.05" in out and "blocked" in out


def test_format_alternatives_marks_the_sampled_token():
    text = charts.format_alternatives(["Thus", "So"], [0.6, 0.3], sampled_index=1)
    assert text == "'Thus' 0.6000\n'So' 0.3000 <- sampled"


def test_empty_figure_carries_message():
    fig = charts.empty_figure("no rows")
    assert fig.layout.annotations[0].text == "no rows" and len(fig.data) == 0
