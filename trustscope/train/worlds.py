"""The toy worlds by name (``--model toy-v2``), registered like rules and importers.

A toy world is one entry of its family's preset table (``TOY_PRESETS`` in :mod:`trustscope.train.toy`,
``MOE_PRESETS`` in :mod:`trustscope.train.toy_moe`, ...): that entry is the world's one declaration, its
configuration, whose fields and module source are hashed into the build's cache key. A family is registered once
here (:func:`register_family`): where its table lives, how a world's configuration is made for a task, and how it
is built. Everything that names toy worlds reads this registry: :func:`trustscope.train.models.resolve_model`
(``trustscope train --model``), ``trustscope parity --model``, the demo's build check and the world table of
``docs/train.md``. A new family: a module with a preset table and a builder, and one :func:`register_family` call.

Importing this module imports no torch; listing or building the worlds imports their family's module.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOY_NAME = re.compile(r"toy([-_.][\w.-]*)?")
"""A model name read as a toy world's (``toy``, ``toy-v2``, ``toy-v3``): one no family holds is refused rather
than looked up on the hub."""


def _replace_task(entry: Any, name: str, task: str | None) -> Any:
    return entry if task is None else dataclasses.replace(entry, task=task)


@dataclass(frozen=True)
class Family:
    """A family of toy worlds: the preset table ``module.table`` (world name -> entry) and how to use an entry."""

    name: str
    module: str  # the module holding the preset table and the builder
    table: str  # the preset table's name in ``module``
    about: str  # one line, for the docs' world table
    build: Callable[[str, Any], Path]  # (world name, configuration) -> the built model's directory
    configure: Callable[[Any, str, str | None], Any] = _replace_task  # (entry, world name, task) -> configuration

    def presets(self) -> dict[str, Any]:
        """The family's preset table (imports the family's module)."""
        return getattr(importlib.import_module(self.module), self.table)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Register a family of toy worlds; a family name or a world name taken already is refused."""
    if family.name in FAMILIES:
        raise ValueError(f"toy world family {family.name!r} is registered already")
    FAMILIES[family.name] = family
    return family


@dataclass(frozen=True)
class World:
    """One toy world: its name, its family and its preset entry."""

    name: str
    family: Family

    def config(self, task: str | None = None) -> Any:
        """The world's configuration, warm-started on ``task`` (its preset's own task when None)."""
        return self.family.configure(self.family.presets()[self.name], self.name, task)

    def build(self, task: str | None = None) -> Path:
        """Build the world on ``task`` (or find it in the cache); its model directory."""
        return self.family.build(self.name, self.config(task))


def worlds() -> dict[str, World]:
    """Every registered toy world by name, family by family in registration order."""
    out: dict[str, World] = {}
    for family in FAMILIES.values():
        for name in family.presets():
            if name in out:
                raise ValueError(f"toy world {name!r} is declared by both {out[name].family.name!r} and "
                                 f"{family.name!r}")
            out[name] = World(name, family)
    return out


def get_world(name: str) -> World | None:
    """The toy world ``name``, or None when no family holds it."""
    return worlds().get(name)


def unknown_world(name: str) -> str:
    """The message refusing a toy-world-like ``name`` no family holds, naming every world."""
    return (f"model={name!r}: no toy world of that name; set model to one of {', '.join(worlds())}, or to a "
            "Hugging Face model directory or hub name")


# ---------------------------------------------------------------------------------------------------------------
# the families


def _build_dense(name: str, config: Any) -> Path:
    from trustscope.train.config import ConfigError
    from trustscope.train.toy import build_toy_model
    from trustscope.train.toy_models import seed_cache

    seed_cache(config)  # a build shipped with trustscope (toy-v2), when the cache lacks it
    try:
        return build_toy_model(config)
    except RuntimeError as exc:  # the warm start fell short of its target: name the world and the task
        if "target_accuracy" not in str(exc):
            raise
        raise ConfigError(f"model={name!r} with task={config.task!r}: {exc}") from None


def _configure_warm(entry: Any, name: str, task: str | None) -> Any:
    from trustscope.train.toy_warm import warm_config

    return warm_config(name, task)


def _build_warm(name: str, config: Any) -> Path:
    from trustscope.train.toy_warm import build_warm_model

    return build_warm_model(name, config.task)


def _build_moe(name: str, config: Any) -> Path:
    from trustscope.train.toy_moe import build_toy_moe_model

    return build_toy_moe_model(config)


def _build_tool(name: str, config: Any) -> Path:
    from trustscope.train.toy_tool import build_toy_tool_model

    return build_toy_tool_model(config)


def _build_wide(name: str, config: Any) -> Path:
    from trustscope.train.toy_wide import build_wide_toy_model

    return build_wide_toy_model(config)


register_family(Family("dense", "trustscope.train.toy", "TOY_PRESETS",
                       "a tiny Qwen2 with a character tokenizer, warm-started on the task", _build_dense))
register_family(Family("warm", "trustscope.train.toy_warm", "WARM_PRESETS",
                       "a dense world warm-started further (the sample logs' and the demo's)", _build_warm,
                       _configure_warm))
register_family(Family("moe", "trustscope.train.toy_moe", "MOE_PRESETS",
                       "a Qwen3-MoE toy (routing logged, replayed on request)", _build_moe))
register_family(Family("tool", "trustscope.train.toy_tool", "TOOL_PRESETS",
                       "the multi-turn world, for a task with a tool", _build_tool))
register_family(Family("wide", "trustscope.train.toy_wide", "WIDE_PRESETS",
                       "a dense or mixture-of-experts world widened to a real vocabulary", _build_wide))


def world_table() -> str:
    """The Markdown table of every toy world (docs/train.md's generated block): name, family, default task."""
    lines = ["| world | family | default task | what it is |", "|---|---|---|---|"]
    for world in worlds().values():
        lines.append(f"| `{world.name}` | {world.family.name} (`{world.family.module}`) | `{world.config().task}` "
                     f"| {world.family.about} |")
    return "\n".join(lines) + "\n"
