"""Rule settings as users write them, one parser for the CLI, the dashboard, the logger and the query layer.

A setting names a registered rule and the parameters it is evaluated at, in one of three forms::

    geo_mask                                  # the rule at its defaults
    geo_mask@0.99                             # its scalar threshold at 0.99 (losses.Threshold: the parameters
                                              # scaled with it move too: high = 1.001 ** (log 0.99 / log 0.999))
    ppo_clip:eps_low=0.1,eps_high=0.1         # parameters given by name, the others at their defaults

:func:`parse_setting` reads one into a :class:`RuleSetting` whose ``name`` is the canonical text of the same
setting: ``parse_setting(s.name) == s`` for every setting, so a name recorded in a run's ``run.json`` or shown in
a summary's ``rule`` column gives its parameters back. Bad input raises ValueError naming the setting, the rule,
the parameter, the value and what the parameter accepts. Imports nothing heavier than the rule catalogue.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trustscope.losses import LossRule, get_loss, list_losses


@dataclass(frozen=True)
class RuleSetting:
    """One rule at given parameters: ``name`` (canonical text, :func:`parse_setting` of it gives this setting
    back), ``rule`` (registered name), ``params`` (every parameter, validated)."""

    name: str
    rule: str
    params: Mapping[str, Any] = field(compare=False)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RuleSetting) and (self.name, self.rule) == (other.name, other.rule)
                and dict(self.params) == dict(other.params))

    def __hash__(self) -> int:
        return hash((self.name, self.rule))


def number_text(value: Any) -> str:
    """A parameter value as settings write it: the shortest text that reads back as the same float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "none" if value is None else str(value)
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _value(text: str, default: Any) -> Any:
    """A parameter's value from its text: None for ``none``, a float where it reads as one, else the text."""
    text = text.strip()
    if text.lower() in ("none", "null"):
        return None
    if isinstance(default, str):
        return text
    try:
        return float(text)
    except ValueError:
        return text


def _rule(setting: str, name: str) -> LossRule:
    if name not in list_losses():
        raise ValueError(f"rule setting {setting!r}: unknown rule {name!r}; registered rules: "
                         f"{', '.join(list_losses())}")
    return get_loss(name)


def _accepts(rule: LossRule) -> str:
    return ", ".join(f"{p} ({spec.bounds()})" for p, spec in rule.params.items()) or "none"


def validated(setting: str, rule: LossRule, given: Mapping[str, Any]) -> dict[str, Any]:
    """``rule``'s defaults with ``given`` on top, checked: an unknown parameter or a value outside a parameter's
    bounds raises ValueError naming the setting, the rule, the parameter, the value and the bounds."""
    unknown = sorted(set(given) - set(rule.params))
    if unknown:
        raise ValueError(f"rule setting {setting!r}: rule {rule.name!r} has no parameter {unknown[0]!r}; its "
                         f"parameters: {_accepts(rule)}")
    merged = {**rule.defaults, **given}
    for name, spec in rule.params.items():
        try:
            spec.check(rule.name, name, merged)
        except ValueError as err:
            raise ValueError(f"rule setting {setting!r}: rule {rule.name!r} parameter {name}={merged[name]!r} is "
                             f"outside its bounds {spec.bounds()} ({err})") from None
    return merged


def threshold_setting(rule_name: str, value: float, base: Mapping[str, Any] | None = None,
                      text: str | None = None) -> RuleSetting:
    """Rule ``rule_name`` with its scalar threshold at ``value`` (the scaled parameters moved with it) from
    ``base`` (default: its defaults)."""
    text = text or f"{rule_name}@{number_text(value)}"
    rule = _rule(text, rule_name)
    threshold = rule.threshold
    if threshold is None:
        family = rule.sql.family if rule.sql else "none"
        raise ValueError(f"rule setting {text!r}: rule {rule_name!r} has no scalar threshold (mask family "
                         f"{family!r}); give its parameters by name instead: {rule_name}:param=value")
    base = dict(base if base is not None else rule.defaults)
    why = threshold.scalable(base)
    if why is not None:
        raise ValueError(f"rule setting {text!r}: rule {rule_name!r}'s threshold {threshold.param} cannot be "
                         f"scaled from {why}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"rule setting {text!r}: rule {rule_name!r} threshold {threshold.param}={value!r} must be "
                         f"a finite number; bounds {rule.params[threshold.param].bounds()}")
    if dict(threshold.scaled)[threshold.param] == "power" and value <= 0:
        spec = rule.params[threshold.param]
        raise ValueError(f"rule setting {text!r}: rule {rule_name!r} parameter {threshold.param}={value!r} is "
                         f"outside its bounds {spec.bounds()} (it must be > 0 to be scaled in log)")
    params = threshold.at(threshold.scale_of(float(value), base), base)
    params[threshold.param] = float(value)  # exactly the value asked for, not its round trip through the scale
    name = f"{rule_name}@{number_text(value)}" if base == rule.defaults else explicit_name(rule, params)
    return RuleSetting(name, rule_name, validated(text, rule, params))


def explicit_name(rule: LossRule, params: Mapping[str, Any]) -> str:
    """``rule:p=v,...`` naming the parameters that differ from the defaults (just ``rule`` when none do)."""
    changed = [f"{p}={number_text(v)}" for p, v in params.items() if v != rule.defaults.get(p)]
    return f"{rule.name}:{','.join(changed)}" if changed else rule.name


def parse_setting(text: str) -> RuleSetting:
    """One setting, ``NAME``, ``NAME@VALUE`` or ``NAME:param=value,...`` (see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"rule setting {text!r}: expected NAME, NAME@VALUE or NAME:param=value,...")
    text = text.strip()
    if "@" in text:
        name, _, value = text.partition("@")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"rule setting {text!r}: {value!r} after '@' is not a number (NAME@VALUE sets the "
                             f"rule's scalar threshold)") from None
        return threshold_setting(name.strip(), number, text=text)
    name, _, rest = text.partition(":")
    rule = _rule(text, name.strip())
    given: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"rule setting {text!r}: {part!r} is not param=value")
        key = key.strip()
        if key in given:
            raise ValueError(f"rule setting {text!r}: parameter {key!r} is given twice")
        spec = rule.params.get(key)
        given[key] = _value(value, spec.default if spec is not None else None)
    params = validated(text, rule, given)
    return RuleSetting(explicit_name(rule, params), rule.name, params)


def parse_settings(texts: Iterable[str | RuleSetting]) -> list[RuleSetting]:
    """Several settings, each its own name (a name given twice is refused)."""
    out: list[RuleSetting] = []
    for text in texts:
        setting = text if isinstance(text, RuleSetting) else parse_setting(text)
        if any(s.name == setting.name for s in out):
            raise ValueError(f"rule setting {setting.name!r} is given twice")
        out.append(setting)
    return out


def rule_params_of(texts: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """``--rule`` options as ``connect(rule_params=...)``: rule -> parameters, one setting per rule (the rule a
    run trained with stays at its own parameters on that run whatever is given here)."""
    out: dict[str, dict[str, Any]] = {}
    for setting in parse_settings(texts or ()):
        if setting.rule in out:
            raise ValueError(f"rule setting {setting.name!r}: rule {setting.rule!r} is already set by another "
                             f"--rule (one setting per rule here)")
        out[setting.rule] = dict(setting.params)
    return out


RULE_OPTION_HELP = ("Evaluate a rule at other parameters (repeatable): NAME:param=value,... or NAME@VALUE (its scalar "
                    "threshold); a run's own rule stays at the parameters it trained with.")
"""The ``--rule`` option's help, shared by ``report``, ``sql``, ``dashboard`` and ``doctor``."""

SETTINGS_ENV = "TRUSTSCOPE_RULE_SETTINGS"
"""The dashboard's ``--rule`` settings, one a line, handed to the Streamlit process."""


def check_budget(share: Any) -> float:
    """A blocked share asked for: a number in (0, 1), the share of the A != 0 tokens each rule should block."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
        raise ValueError(f"budget={share!r} is outside (0, 1): it is the share of the tokens with A != 0 each "
                         f"rule should block")
    return float(share)
