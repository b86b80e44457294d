"""The early warning's attach chain, written once (trustscope/integrations/wiring.py): settings refused before
anything is built, the reporter and the alerts built as the settings say, and TRL's and verl's attach building
theirs through it rather than a copy of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trustscope.integrations.wiring import WarningWiring

ROOT = Path(__file__).resolve().parents[1]


class Logger:
    """Stands in for the TokenLogger: the chain keeps it, nothing is read from it here."""


def test_bad_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="webhook url 'slack' must start with http"):
        WarningWiring.check("slack", None)
    with pytest.raises(ValueError, match=r"relative_z=-1 must be a finite number > 0"):
        WarningWiring.check(None, -1)
    wiring = WarningWiring.check(" https://hooks.example/T0 ", 6)
    assert wiring.webhook == "https://hooks.example/T0" and wiring.lines.relative_z == 6


@pytest.mark.parametrize(("webhook", "trackers", "posts", "alerts_to"), [
    ("https://hooks.example/T0", None, True, ("https://hooks.example/T0", set())),
    (None, "wandb", True, (None, {"wandb"})),
    (None, ["tensorboard", "trackio"], True, (None, {"trackio"})),
    (None, "all", True, (None, {"wandb", "trackio"})),
    (None, ["console", "tensorboard"], True, None),  # nobody would receive an alert
    ("https://hooks.example/T0", "wandb", False, None),  # another process posts
])
def test_the_chain_builds_alerts_only_where_someone_receives_them(webhook, trackers, posts, alerts_to):
    wiring, logger = WarningWiring.check(webhook, 6), Logger()
    reporter, alerts = wiring.build(logger, trackers, metrics=True, posts=posts, wait_s=0.25)
    try:
        assert reporter.logger is logger and reporter.alerts is alerts and reporter.wait_s == 0.25
        assert reporter.warning.lines is wiring.lines  # the checked lines, not a default
        if alerts_to is None:
            assert alerts is None
        else:
            assert (alerts.url, alerts.trackers.names) == alerts_to and alerts.logger is logger
    finally:
        if alerts is not None:
            alerts.close()


def test_no_metrics_builds_nothing():
    assert WarningWiring.check("https://hooks.example/T0", None).build(Logger(), "wandb", metrics=False) == (None,
                                                                                                            None)


def _attach_calls(path: Path) -> tuple[set[str], set[str]]:
    """The names ``attach`` in ``path`` calls: (attribute calls such as ``WarningWiring.check``, plain calls)."""
    tree = ast.parse(path.read_text())
    (attach,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "attach"]
    attrs, plain = set(), set()
    for node in ast.walk(attach):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                attrs.add(node.func.attr)
            elif isinstance(node.func, ast.Name):
                plain.add(node.func.id)
    return attrs, plain


@pytest.mark.parametrize("module", ["trustscope/integrations/trl/attach.py", "trustscope/integrations/verl/attach.py"])
def test_each_attach_builds_its_chain_through_the_wiring(module):
    attrs, plain = _attach_calls(ROOT / module)
    assert {"check", "build"} <= attrs, f"{module}'s attach does not build the warning chain through WarningWiring"
    copied = plain & {"Alerts", "StepReporter", "LiveTrackerAlerts", "WarningLines", "check_webhook_url"}
    assert not copied, f"{module}'s attach builds {sorted(copied)} itself; build them with WarningWiring"
