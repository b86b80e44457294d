"""The integrated trainer and its toy world.

- :mod:`trustscope.train.config`: :class:`TrainConfig`, the one configuration dataclass, and its loader.
- :mod:`trustscope.train.loop`: :func:`train`, the GRPO-style loop with any registered trust-region rule.
- :mod:`trustscope.train.tasks`: verifiable tasks and rewards; :mod:`trustscope.train.toy`: the tiny model.

``from trustscope.train import TrainConfig, train`` works; the names load lazily, so importing a submodule
(``trustscope.train.tasks``) does not pull in the trainer, vLLM or the logger.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainConfig", "load_config", "train"]


def __getattr__(name: str) -> Any:
    if name in ("TrainConfig", "load_config"):
        from trustscope.train import config

        return getattr(config, name)
    if name == "train":
        from trustscope.train.loop import train

        return train
    raise AttributeError(f"module 'trustscope.train' has no attribute {name!r}")
