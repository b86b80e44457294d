"""The early warning's wiring of a framework attach, written once for every framework (TRL, verl).

An attach checks the user's warning settings before it builds anything (:meth:`WarningWiring.check`: a malformed
webhook URL or ``warn_relative`` raises ``ValueError`` naming it, and nothing is logged yet), builds its own
:class:`~trustscope.logger.TokenLogger`, then the chain the logger feeds (:meth:`WarningWiring.build`):

    logger -> StepReporter (a step's exact summaries and the early warning's lines, as ``trustscope/...`` metrics)
           -> Alerts (the warning posted to the webhook, and raised in the framework's own W&B / trackio run)

The alerts exist only when the metrics do and something would receive them (a webhook, or W&B / trackio among
the framework's trackers), and only in the process that posts (one per run).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trustscope.alerts import Alerts, check_webhook_url
from trustscope.trackers import LiveTrackerAlerts, StepReporter


@dataclass(frozen=True)
class WarningWiring:
    """The warning settings of an attach, checked: the webhook URL (None: none) and the warning's lines."""

    webhook: str | None
    lines: Any  # trustscope.early_warning.WarningLines

    @classmethod
    def check(cls, webhook: str | None, warn_relative: float | None) -> WarningWiring:
        """Check ``webhook`` (an http(s) URL or None) and ``warn_relative`` (robust deviations or None) before the
        attach builds anything; a bad one raises ``ValueError`` naming the value."""
        from trustscope.early_warning import WarningLines

        url = None if webhook is None else check_webhook_url(webhook)
        return cls(url, WarningLines(relative_z=warn_relative))

    def build(self, logger: Any, trackers: Iterable[str] | str | None, *, metrics: bool, posts: bool = True,
              wait_s: float | None = None) -> tuple[StepReporter | None, Alerts | None]:
        """The reporter and the alerts ``logger`` feeds: ``(None, None)`` without ``metrics``; the alerts when
        this process ``posts`` and the webhook or a live tracker among ``trackers`` (the framework's own tracker
        names: ``"wandb"``, ``["trackio", ...]``, ``"all"``) would receive them. ``wait_s``: how long the reporter
        may wait for the logger to summarise a step (None: the reporter's default)."""
        if not metrics:
            return None, None
        in_trackers = LiveTrackerAlerts(trackers or [])
        alerts = (Alerts(self.webhook, logger=logger, trackers=in_trackers)
                  if posts and (self.webhook is not None or in_trackers.names) else None)
        waits = {} if wait_s is None else {"wait_s": wait_s}
        return StepReporter(logger, alerts=alerts, lines=self.lines, **waits), alerts
