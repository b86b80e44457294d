"""What a run trains and where: the device (:func:`resolve_device`), the model directory (:func:`resolve_model`: a
registered toy world, built or found in the cache, or a Hugging Face directory or hub name) and the portable
names a run manifest records (:func:`portable`).
"""

from __future__ import annotations

import os
from pathlib import Path

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.models")

from trustscope.train.config import ConfigError, TrainConfig
from trustscope.train.worlds import TOY_NAME, get_world, unknown_world


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no GPU; set device=cpu or device=auto")
    return torch.device(name)

def resolve_model(cfg: TrainConfig) -> Path | str:
    """The model directory: a registered toy world (:mod:`trustscope.train.worlds`: ``toy``, ``toy-v2``,
    ``toy-v2-warm``, ``toy-moe``, ``toy-tool``, ``toy-v2-152k``, ...) warm-started on ``cfg.task``, built and cached
    on first use, or copied from :mod:`trustscope.train.toy_models` where it ships built; or ``cfg.model`` as given.
    A name that looks like a toy world's but is none (and no such directory exists) is refused naming them all."""
    world = get_world(cfg.model)
    if world is not None:
        return world.build(cfg.task)
    if TOY_NAME.fullmatch(cfg.model) and not Path(cfg.model).exists():
        raise ConfigError(unknown_world(cfg.model))
    return cfg.model


def portable(path: Path | str) -> str:
    """``path`` as a run manifest records it, naming no directory of the machine that wrote it: a build in the
    trustscope cache (a toy world) by its place in the cache (``toy/<task>-<key>``), a path under the working
    directory relative to it, anything else (a hub name, a model elsewhere) as given."""
    from trustscope.paths import cache_root

    text = str(path)
    if not os.path.isabs(text):
        return text
    resolved = Path(text).resolve()
    for root in (cache_root(), Path.cwd()):
        root = root.resolve()
        if resolved.is_relative_to(root) and resolved != root:
            return resolved.relative_to(root).as_posix()
    return text
