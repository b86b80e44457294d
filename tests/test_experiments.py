"""The sweep presets of ``studies/experiments.py`` and the headline judgement of ``studies/findings.py``."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest


@pytest.fixture(scope="module")
def scripts():
    from studies import experiments, findings

    return experiments, findings


def test_the_collapse_preset_is_the_warm_climb_with_more_updates_a_step(scripts):
    """``sanity-climb-collapse`` differs from ``sanity-climb-warm`` in the mini-batch updates a step alone (the
    knob that moves pi away from mu within a step), on the same warm world, with the headline's rules first."""
    exp, _ = scripts
    warm, collapse = exp.PRESETS["sanity-climb-warm"], exp.PRESETS["sanity-climb-collapse"]
    changed = {k for k in warm.setting.keys() | collapse.setting.keys()
               if warm.setting.get(k) != collapse.setting.get(k)}
    assert changed == {"mini_batches"} and collapse.setting["mini_batches"] > warm.setting["mini_batches"]
    batch = collapse.setting["prompts_per_step"] * collapse.setting["group_size"]
    assert batch % collapse.setting["mini_batches"] == 0
    assert collapse.toy == warm.toy == "toy-v2-warm" and collapse.logdir != warm.logdir
    assert collapse.rules[:4] == ("dppo_binary_tv", "grpo", "ppo_clip", "dppo_binary_kl")
    assert {"pg_is", "cispo"} <= set(collapse.rules) and len(collapse.seeds) >= 8
    runs = exp.plan(collapse, list(collapse.rules), [0, 1], probe=False)
    assert [rid for rid, _ in runs[:2]] == ["sanity-dppo_binary_tv-s0", "sanity-grpo-s0"] and len(runs) == 12


def test_the_stale_preset_is_the_warm_climb_with_rollouts_two_steps_behind(scripts):
    """``sanity-climb-stale`` differs from ``sanity-climb-warm`` in the policy lag alone (how many steps of updates
    mu trails pi by), on the same warm world and rules, 8 seeds."""
    exp, _ = scripts
    warm, stale = exp.PRESETS["sanity-climb-warm"], exp.PRESETS["sanity-climb-stale"]
    changed = {k for k in warm.setting.keys() | stale.setting.keys() if warm.setting.get(k) != stale.setting.get(k)}
    assert changed == {"policy_lag"} and stale.setting["policy_lag"] == warm.setting["policy_lag"] + 1 == 2
    assert stale.toy == "toy-v2-warm" and stale.rules == warm.rules and len(stale.seeds) >= 8
    assert stale.logdir not in (warm.logdir, exp.PRESETS["sanity-climb-collapse"].logdir)


def test_an_unknown_preset_fails_naming_it(scripts, monkeypatch, capsys):
    exp, _ = scripts
    monkeypatch.setattr(sys, "argv", ["experiments.py", "run", "--preset", "sanity-climb-hot", "--dry-run"])
    with pytest.raises(SystemExit):
        exp.main()
    err = capsys.readouterr().err
    assert "--preset" in err and "sanity-climb-hot" in err and "sanity-climb-collapse" in err


def _table(steps: dict[str, list[float]]) -> pd.DataFrame:
    rows = [{"kind": "sweep", "rule": rule, "seed": i, "steps_to_target": s, "reward_all": 0.9, "eval_final": 1.0,
             "collapse": np.nan} for rule, values in steps.items() for i, s in enumerate(values)]
    return pd.DataFrame(rows)


def test_the_headline_names_a_rule_only_when_the_interval_excludes_zero(scripts):
    """Steps to 0.9 (fewer is better): a clear gap favours the faster rule, either way round; the same seeds favour
    neither."""
    _, fnd = scripts
    fast, slow = [60.0, 62.0, 61.0, 63.0], [90.0, 92.0, 91.0, 93.0]
    lines = fnd.headline_markdown(_table({"dppo_binary_tv": fast, "grpo": slow, "ppo_clip": fast,
                                          "dppo_binary_kl": slow})).splitlines()
    row = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[-2].strip() for line in lines[2:]}
    assert row[("DPPO binary TV - GRPO", "steps to 0.9")] == "DPPO binary TV"
    assert row[("DPPO binary KL - GRPO Clip-Higher", "steps to 0.9")] == "GRPO Clip-Higher"
    assert row[("DPPO binary TV - GRPO Clip-Higher", "steps to 0.9")] == "-"
    assert row[("DPPO binary KL - GRPO", "steps to 0.9")] == "-"
    assert row[("DPPO binary TV - GRPO", "collapsed")] == "-" and len(row) == 16
