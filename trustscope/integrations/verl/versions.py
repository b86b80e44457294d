"""Which verl this integration reads, and the refusal of one whose loop differs from what :func:`attach` reads.

Within :data:`SUPPORTED_VERL` each verl internal is probed where it is used (:func:`need`, :func:`require_attrs`),
never the version string; :func:`check_loop` reads, before the first step, the fields and the call order of verl's
update loop that the logging relies on, and refuses a release whose loop differs, naming the release and the field.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

from trustscope.extras import release_position

SUPPORTED_VERL = ">=0.8,<0.10"
"""The verl releases this module supports (the ``[verl]`` extra's range; docs/verl.md has the table). Within it each
internal is probed where it is used (:class:`VerlVersionError` names a missing one), never the version string."""

CORE = "verl.trainer.ppo.core_algos"

UPDATE_FIELDS = ("global_batch_size", "epochs")
"""What verl's ``_update_actor`` hands the actors and the hook reads to number the updates of a call: the rows of a
mini-batch (``ppo_mini_batch_size x rollout.n``; the actors' micro-batches keep it) and the epochs over them."""

V1_LOOP_ATTRS = ("parameter_sync_step", "local_trigger_step")
"""What verl's V1 ``PPOTrainer.step`` keeps while it calls ``_update_actor`` once per trigger of a step."""


class VerlVersionError(RuntimeError):
    """The installed verl lacks a module or attribute this integration relies on (its internals moved)."""


def verl_version() -> str:
    """The installed verl's version; an ImportError that says how to install it when verl is absent."""
    try:
        import verl
    except ImportError as err:
        raise ImportError(f"trustscope.integrations.verl needs verl ({err}); install it with "
                          f"pip install 'trustscope[verl]' (verl{SUPPORTED_VERL})") from err
    return str(getattr(verl, "__version__", "unknown"))


def need(module_name: str, attr: str) -> Any:
    """``module_name.attr`` from verl, or a :class:`VerlVersionError` naming the version and what is missing."""
    version = verl_version()
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise VerlVersionError(f"verl {version}: module {module_name} cannot be imported ({err}); "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}") from err
    if not hasattr(module, attr):
        raise VerlVersionError(f"verl {version}: {module_name}.{attr} is missing; "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}")
    return getattr(module, attr)


def check_release(version: str) -> None:
    """A :class:`VerlVersionError` for a verl older than :data:`SUPPORTED_VERL`, a warning for a newer one."""
    position = release_position(version, SUPPORTED_VERL)
    if position == 0:
        return
    if position < 0:
        raise VerlVersionError(f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}; the installed verl "
                               f"{version} is older: pip install 'trustscope[verl]' (or 'verl{SUPPORTED_VERL}')")
    warnings.warn(f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}, this is verl {version}: its "
                  f"internals are checked as they are used, but check the log against verl's own metrics",
                  stacklevel=3)


def require_attrs(obj: Any, what: str, attrs: tuple[str, ...]) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise VerlVersionError(f"verl {verl_version()}: {what} has no {', '.join(missing)}; "
                               f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}")


def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):  # built without sources: nothing to read, the actors check again at their call
        return None


def check_loop(trainer: Any, v1: bool) -> None:
    """Refuse (:class:`VerlVersionError`, naming the release and the field) a verl whose update loop differs from
    what the logging reads: ``_update_actor`` must hand the actors :data:`UPDATE_FIELDS` (the hook numbers each
    micro-batch's update from them), and on the V1 trainer ``PPOTrainer.step`` must keep
    :data:`V1_LOOP_ATTRS` and set ``local_trigger_step`` before it calls ``_step_once`` (which calls
    ``_update_actor``), once per trigger. Runs at attach, before the first step."""
    version = verl_version()
    update = getattr(type(trainer), "_update_actor", None)
    text = _source(update) if update is not None else None
    if text is not None:
        for field in UPDATE_FIELDS:
            if field not in text:
                raise VerlVersionError(f"verl {version}: {type(trainer).__name__}._update_actor no longer hands the "
                                       f"actors {field!r}, from which trustscope numbers the updates of a step "
                                       f"(update_index); trustscope.integrations.verl supports verl {SUPPORTED_VERL}")
    if not v1:
        return
    require_attrs(trainer, f"trainer {type(trainer).__name__}", V1_LOOP_ATTRS)
    step = getattr(type(trainer), "step", None)
    text = _source(step) if step is not None else None
    if text is not None:
        order = [text.find(s) for s in ("range(self.parameter_sync_step)", "self.local_trigger_step =", "_step_once(")]
        if min(order) < 0 or order != sorted(order):
            raise VerlVersionError(f"verl {version}: {type(trainer).__name__}.step no longer sets local_trigger_step "
                                   f"before _step_once in its loop over parameter_sync_step (the call order "
                                   f"trustscope numbers a step's updates by); trustscope.integrations.verl supports "
                                   f"verl {SUPPORTED_VERL}")
