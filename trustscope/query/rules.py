"""Which parameters every rule is evaluated at, per run: the views' rule bindings.

Each run's own rule at the parameters in its ``run.json``; every other rule at the defaults of
:mod:`trustscope.losses` or the caller's choice (counterfactuals). Values are bound through DuckDB variables,
never formatted into SQL.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trustscope import runformat
from trustscope.framework_metrics import PARAMETERS as FRAMEWORK_PARAMETERS
from trustscope.losses import get_loss, list_losses

RULES_ENV = "TRUSTSCOPE_RULES"
"""Comma-separated dotted paths of rule modules (``my_pkg.rules``) to import before a log directory opens, so a
dashboard or report shows a user's rules. A log directory never imports code by itself."""

ANALYSIS_DEFAULTS: dict[str, float] = {
    "bad_negative_delta": float(get_loss("minimal_negative_mask").defaults["delta"]),
    "ratio_log10_min": -3.0,
    "ratio_log10_max": 3.0,
    "ratio_bins": 60,
    "divergence_log10_min": -8.0,
    "divergence_log10_max": 0.0,
    "divergence_bins": 64,
    **FRAMEWORK_PARAMETERS,
}
"""Settings of the analysis views. The bad negative-update delta is minimal_negative_mask's own default; the
frameworks' thresholds are :data:`trustscope.framework_metrics.PARAMETERS`."""


def bindable(params: dict[str, Any]) -> dict[str, Any]:
    """Numbers as floats (one SQL type per parameter across runs), everything else as it is; a rule without
    parameters gets a placeholder field (a SQL struct needs one)."""
    out = {k: float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in params.items()}
    return out or {"none": None}


def rule_parameters(overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every registered rule's parameters, ready to bind: the defaults (from :mod:`trustscope.losses`), with
    ``overrides`` (rule -> parameters, validated by the rule) on top."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(list_losses()))
    if unknown:
        raise ValueError(f"rule_params names unknown rule(s) {unknown}; registered: {list_losses()}")
    return {name: bindable(get_loss(name).resolve(**overrides.get(name, {}))) for name in list_losses()}


def run_rule(manifest: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The rule a run trained with and its parameters, from its manifest: top-level ``loss_rule`` (else the
    trainer config's ``loss``), and top-level ``loss_params`` (else the config's ``loss_params`` when the config
    names the same rule). A dotted path names the rule by its last part. Parameters are not validated here."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    rule = manifest.get("loss_rule") or config.get("loss")
    if not isinstance(rule, str) or not rule:
        return None, {}
    params = manifest.get("loss_params")
    if not isinstance(params, dict):
        same = config.get("loss") in (None, rule) or str(config.get("loss")).rsplit(":", 1)[-1] == rule
        params = config.get("loss_params") if same and isinstance(config.get("loss_params"), dict) else {}
    return rule.replace(":", ".").rsplit(".", 1)[-1], dict(params)


def load_rules(modules: str | Sequence[str] | None = None) -> list[str]:
    """Import rule modules by dotted path (``my_pkg.rules``, or ``my_pkg.rules:my_rule`` for one rule) so their
    ``@register_loss`` rules join the catalogue; ``modules`` defaults to ``$TRUSTSCOPE_RULES`` (comma-separated).
    Returns the registered rule names afterwards."""
    if modules is None:
        modules = os.environ.get(RULES_ENV, "")
    names = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else list(modules)
    for name in filter(None, names):
        if ":" in name:
            get_loss(name)
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"{RULES_ENV}: cannot import rule module {name!r} ({err})") from None
    return list_losses()


class RuleBinding:
    """The rule parameters a connection binds, and each run's own rule, read from its run.json (again when it
    changes). ``rule_params``: every rule's counterfactual parameters (:func:`rule_parameters`)."""

    def __init__(self, rule_params: dict[str, dict[str, Any]]) -> None:
        self.rule_params = rule_params
        self._manifests: dict[Path, tuple[int, tuple[str | None, str | None, dict[str, Any]]]] = {}

    def run_rule(self, run: Path) -> tuple[str | None, str | None, dict[str, Any]]:
        """(run_id, the rule run ``run`` trained with, its parameters) (see :func:`run_rule`)."""
        path = run / runformat.MANIFEST
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return None, None, {}
        if run not in self._manifests or self._manifests[run][0] != stamp:
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                manifest = {}
            manifest = manifest if isinstance(manifest, dict) else {}
            self._manifests[run] = (stamp, (manifest.get("run_id") or run.name, *run_rule(manifest)))
        return self._manifests[run][1]

    def rule_sets(self, runs: Sequence[Path]) -> dict[Path, tuple[str, dict[str, dict[str, Any]]]]:
        """Per run directory: (run_id, every rule's parameters): the run's own rule with the parameters it trained
        with (its defaults where run.json records none, whatever the caller chose for counterfactuals), every other
        rule with :attr:`rule_params`. Parameters the rule rejects leave its defaults (see :meth:`run_rules`)."""
        out = {}
        for run in runs:
            run_id, rule, params = self.run_rule(run)
            rules = self.rule_params
            if rule in self.rule_params:
                try:
                    own = get_loss(rule).resolve(**params)
                except (TypeError, ValueError):
                    own = get_loss(rule).defaults
                rules = {**rules, rule: bindable(own)}
            out[run] = (run_id or run.name, rules)
        return out

    def params(self, runs: Sequence[Path], **analysis: float) -> dict[str, Any]:
        """What the views bind as ``trustscope_params``: the rule sets (set 1: the defaults or the caller's
        choice; one more per run: its own), which set each run reads, and the analysis settings."""
        unknown = set(analysis) - set(ANALYSIS_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown analysis parameter(s) {sorted(unknown)}; known: {sorted(ANALYSIS_DEFAULTS)}")
        sets_of_runs = list(self.rule_sets(runs).values())
        sets = [self.rule_params, *(rules for _, rules in sets_of_runs)]
        run_sets = [{"run_id": "", "rule_set": 1}]
        run_sets += [{"run_id": run_id, "rule_set": i} for i, (run_id, _) in enumerate(sets_of_runs, start=2)]
        values = {rule: {param: [s[rule][param] for s in sets] for param in self.rule_params[rule]}
                  for rule in self.rule_params}
        return {"rules": self.rule_params, "rule_values": values, "run_sets": run_sets,
                "analysis": {**ANALYSIS_DEFAULTS, **analysis}}

    def catalogue_rows(self) -> list[dict[str, Any]]:
        """The rule catalogue as the views see it: rule, family, sequence (reads the whole response), parameters
        (the counterfactual parameters, JSON), summary, and sql (False: the rule has no SQL mask family, so the
        views have no ``blocks_<rule>`` column for it). One row per registered rule, sorted by name."""
        rows = []
        for name in list_losses():
            rule = get_loss(name)
            rows.append({"rule": name, "family": rule.sql.family if rule.sql else None,
                         "sequence": bool(rule.sql and rule.sql.sequence),
                         "parameters": json.dumps({k: v for k, v in self.rule_params[name].items()
                                                   if k in rule.defaults}, default=str),
                         "summary": rule.doc, "sql": rule.sql is not None})
        return rows

    def run_rule_rows(self, runs: Sequence[Path]) -> list[dict[str, Any]]:
        """Per run: run_id, loss_rule (the rule it trained with, from run.json), parameters (JSON: those the SQL
        binds for that rule), and source: 'run' (the run's own parameters), 'defaults' (none recorded), 'unknown
        rule' (not registered in this process) or the error the rule raised on the recorded parameters."""
        rows = []
        for run in runs:
            run_id, rule, params = self.run_rule(run)
            if rule not in self.rule_params:
                rows.append({"run_id": run_id, "loss_rule": rule, "parameters": json.dumps(params, default=str),
                             "source": "unknown rule" if rule else "defaults"})
                continue
            try:
                bound, source = get_loss(rule).resolve(**params), "run" if params else "defaults"
            except (TypeError, ValueError) as err:
                bound, source = get_loss(rule).defaults, str(err)
            rows.append({"run_id": run_id, "loss_rule": rule, "parameters": json.dumps(bound, default=str),
                         "source": source})
        return rows
