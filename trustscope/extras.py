"""Which install extra brings which library, and the error that says so when one is missing.

``pip install trustscope`` installs what reading logs needs: the query layer, the dashboard, ``sql``, ``report``,
``doctor``, ``validate`` and the JSON-lines importers. The trainer, the capture engines, the framework
integrations and the ``.pt`` importers need libraries an extra brings (``pyproject.toml``'s
``[project.optional-dependencies]``). A module that needs one imports it under :func:`missing`, and a command that
reaches one through a lazy import is answered by :func:`message` (:func:`trustscope.entry.main`), so a reader's
install says which extra to add instead of a bare ``No module named 'torch'``.
"""

from __future__ import annotations

from typing import NoReturn

TRAIN = "train"
EXTRAS = {
    "torch": TRAIN,
    "transformers": TRAIN,
    "tokenizers": TRAIN,
    "safetensors": TRAIN,
    "vllm": "cpu",
    "trl": "trl",
    "verl": "verl",
    "omegaconf": "verl",
    "tensordict": "verl",
    "transfer_queue": "verl",
    "s3fs": "s3",
    "ray": "ray",
    "wandb": "trackers",
    "tensorboard": "trackers",
    "mlflow": "trackers",
    "trackio": "trackers",
}
"""``{top-level module: the extra that installs it}``; ``tests/test_dependencies.py`` checks each against
``pyproject.toml``."""

HINTS = {"cpu": " (on a CUDA machine: pip install 'trustscope[gpu]')"}
"""What the install line of an extra adds: vLLM comes in two builds."""


class MissingExtra(ModuleNotFoundError):
    """A library an install extra brings is not installed; the message names the extra."""


def extra_for(module: str | None) -> str | None:
    """The extra that installs ``module`` (a dotted name: its top level counts), or None when none does."""
    return EXTRAS.get((module or "").partition(".")[0])


def message(module: str, needed_by: str, extra: str | None = None) -> str:
    """``<needed_by> needs <module>, which this install lacks: pip install 'trustscope[<extra>]'``; ``extra``
    defaults to the one that installs ``module``."""
    top = module.partition(".")[0]
    extra = extra or EXTRAS[top]
    return (f"{needed_by} needs {top}, which this install lacks: pip install 'trustscope[{extra}]'"
            f"{HINTS.get(extra, '')}")


def missing(exc: ModuleNotFoundError, needed_by: str, extra: str | None = None) -> NoReturn:
    """Raise :class:`MissingExtra` for ``exc`` when an extra installs the module it could not find, else ``exc``
    itself (a module missing from the default install is a broken install, not a missing extra). ``extra``: the
    one to name when it is not the module's own (an integration needs its framework's extra, which brings torch)::

        try:
            import torch
        except ModuleNotFoundError as exc:
            missing(exc, "trustscope.capture")
    """
    if extra_for(exc.name) is None:
        raise exc
    raise MissingExtra(message(exc.name or "", needed_by, extra), name=exc.name) from exc


def release_position(version: str, supported: str) -> int:
    """Where release ``version`` stands against ``supported`` (``">=A,<B"``, an extra's range): -1 older than A,
    0 inside, 1 at B or newer; 0 for a version string that is no release number (a fork's own: its internals
    are probed where they are used). Release numbers compare as integers (``1.10 > 1.9``); pre-release tags
    are ignored."""
    import re

    def release(text: str) -> tuple[int, ...] | None:
        match = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
        return tuple(int(p) for p in match.group(1).split(".")) if match else None

    bounds = dict(part.strip().split("=", 1) if "=" in part else (part.strip()[0], part.strip()[1:])
                  for part in supported.split(","))
    here, low, high = release(version), release(bounds[">"]), release(bounds["<"])
    if here is None:
        return 0
    if here < low:
        return -1
    return 1 if here >= high else 0
