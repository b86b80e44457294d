"""Attaching to a verl trainer: the driver's logger, the wrapped ``_update_actor`` and the hook sent to the actors.

The driver never waits on a writer: it commits its own rows on its logger's writer thread, never polls the actors'
manifests, and a step's figures that need every actor rank (the exact summaries, the early warning) are published
into verl's step metrics when they are ready, at a later ``_update_actor`` call, marked by ``trustscope/step``
(:meth:`VerlLogging.publish_ready`). A logging problem at resume (a rank log ending before the checkpoint, an
``s3://`` run, a resume on fewer or more ranks) is a logging incident (one warning, a counter in the step's
scalars, a ``trustscope validate`` finding); training goes on and no committed row is lost.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from trustscope.integrations.verl.actor import ActorLogHook, FinishActors
from trustscope.integrations.verl.driver import (
    KEPT_SCALARS,
    META_KEYS,
    ROW_KEYS,
    VERSION_KEY,
    VERSION_LAST_KEY,
    actor_scalars,
    log_driver_batch,
    read_v1_batch,
    tag_versions,
    unstamp_batch,
    updates_of_call,
)
from trustscope.integrations.verl.layout import check_actor_config
from trustscope.integrations.verl.losses import rule_of_loss_mode
from trustscope.integrations.verl.masks import VERL_MASKS
from trustscope.integrations.verl.rollout import RejectionMask
from trustscope.integrations.verl.versions import check_loop, check_release, need, require_attrs, verl_version
from trustscope.logger import TokenLogger


def _to_plain(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that only resolves inside verl's workers
        return OmegaConf.to_container(cfg, resolve=False)


class VerlLogging:
    """What :func:`attach` set up: the driver's logger and the actor hook. :meth:`close` at the end of training.

    Each ``_update_actor`` call of a step gets sample ids after the step's earlier calls' (unique within the step)
    and the index of its first update (the earlier calls' updates before it); verl's actor metrics of the step's
    calls are logged once, their mean, with the step's last call (:attr:`calls_per_step`).
    """

    def __init__(self, trainer: Any, logger: TokenLogger, hook: ActorLogHook, update_actor: Callable[..., Any],
                 reporter: Any = None, alerts: Any = None, resume: bool = False, rejection: RejectionMask | None = None,
                 calls_per_step: int = 1):
        self.trainer = trainer
        self.logger = logger
        self.hook = hook
        self._update_actor = update_actor
        self.reporter = reporter
        """Adds a step's summaries to verl's step metrics once every actor rank committed it (None: ``metrics=False``)."""
        self.alerts = alerts
        self.rejection = rejection
        self.calls_per_step = calls_per_step
        """``_update_actor`` calls per global step: verl V1's ``parameter_sync_step``, else 1."""
        self._resume_pending = resume
        """Cut the run back to the step verl restored, at the first actor update (:meth:`resume_at`)."""
        self._step: int | None = None
        self._calls = self._next_id = self._next_update = 0
        self._scalars: dict[str, list[float]] = {}
        self._flushed: set[str] = set()  # scalar names the open step has logged
        self._unpublished: list[int] = []  # steps whose summaries are not yet in verl's metrics
        actor = cfg_get(trainer.config, "actor_rollout_ref.actor")
        self.mini_batch = int(actor.get("ppo_mini_batch_size", 1) or 1) * int(
            cfg_get(trainer.config, "actor_rollout_ref.rollout").get("n", 1) or 1)
        self.epochs = int(actor.get("ppo_epochs", 1) or 1)
        self._save_checkpoint = getattr(trainer, "_save_checkpoint", None)
        if self._save_checkpoint is not None:
            trainer._save_checkpoint = self.save_checkpoint

    def resume_at(self, step: int) -> int:
        """The run resumes at ``step`` (verl restored its checkpoint of ``step - 1``, or started over at step 1):
        every rank's rows after ``step - 1`` go (the driver's through its open logger, the actors' before their
        loggers open), so the resumed steps are logged once. A rank whose log ends before the checkpoint (steps a
        crash lost before their commit, an ``s3://`` run, a resume on fewer or more ranks) is a logging incident
        (:mod:`trustscope.runformat.incidents`: one warning, the rank's manifest, ``trustscope validate`` and the
        ``trustscope/incidents/...`` step scalars); a cut that fails all the same is one warning. Training goes
        on, and every committed row up to the checkpoint stays. Returns the files removed."""
        from trustscope.runformat.cutback import drop_steps_after

        self._resume_pending = False
        kept = step - 1 if step > 1 else -1  # verl counts steps from 1
        options = self.hook.logger_options.get("storage_options")
        removed = 0
        for what, cut in (("rank 0", lambda: self.logger.cut_back(kept)),
                          ("the actor ranks", lambda: drop_steps_after(self.logger.run_dir, kept, ranks=range(1, 2**31),
                                                                       resume=True, storage_options=options))):
            try:
                removed += cut()
            except Exception as err:
                warnings.warn(f"trustscope: resuming run {self.logger.run_id!r} at step {step}, {what} could not be "
                              f"cut back after step {kept}: {err} (training goes on; rows after the checkpoint may "
                              f"be logged twice)", stacklevel=3)
        return removed

    def actors_committed(self, step: int) -> bool:
        """Whether every actor rank of the run has committed ``step``: one read of each rank's manifest, never a
        wait (local or shared log directories; object storage: False)."""
        from trustscope.runformat.commits import publishing_files
        from trustscope.runformat.manifest import read_json
        from trustscope.runformat.status import effective_status

        run_dir = self.logger.run_dir
        if not isinstance(run_dir, os.PathLike):
            return False
        paths = [p for p in sorted((run_dir / "ranks").glob("rank*.json")) if p.stem != "rank0"]
        if not paths:
            return False
        for path in paths:
            try:
                manifest = read_json(path)
            except Exception:
                return False
            last = manifest.get("last_step")
            landing = [f for f in publishing_files(manifest) if not (run_dir / f).exists()]
            if effective_status(manifest) == "running" and (last is None or last < step or landing):
                return False
        return True

    def publish_ready(self, metrics: dict[str, Any]) -> None:
        """Add to ``metrics`` (verl's step metrics) the summaries of the earlier steps every actor rank has
        committed by now, each marked by ``trustscope/step``; the others wait for a later call. Never raises into
        training."""
        from trustscope.trackers import committed_step_rows

        if self.reporter is None:
            return
        while self._unpublished and self.actors_committed(self._unpublished[0]):
            step = self._unpublished.pop(0)
            try:
                rows = committed_step_rows(self.logger.run_dir, step, ranks=None)
                metrics.update(self.reporter.from_rows(rows, step))
            except Exception as err:
                warnings.warn(f"trustscope: step {step}'s summaries could not be added to verl's metrics: {err!r}",
                              stacklevel=3)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """verl's ``_save_checkpoint``, the driver's rows of the step handed to its writer thread first (never a
        wait: a rank whose log ends before the checkpoint at resume is a warning, :meth:`resume_at`)."""
        self.logger.commit_step()
        return self._save_checkpoint(*args, **kwargs)

    @property
    def run_id(self) -> str:
        return self.logger.run_id

    def _begin_call(self, n: int) -> tuple[int, int, int, int]:
        """``(step, first sample id, first update, updates)`` of an ``_update_actor`` call of ``n`` rows."""
        step = int(self.trainer.global_steps)
        if self._resume_pending:
            self.resume_at(step)
        if step != self._step:
            if self._step is not None:
                self._unpublished.append(self._step)
                self._flush_scalars()  # a step of fewer calls than announced
            self._step, self._calls, self._next_id, self._next_update, self._flushed = step, 0, 0, 0, set()
        updates = updates_of_call(n, self.mini_batch, self.epochs)
        out = (step, self._next_id, self._next_update, updates)
        self._calls += 1
        self._next_id += n
        self._next_update += updates
        return out

    def _end_call(self, step: int, metrics: dict[str, Any], scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self._scalars.setdefault(name, []).append(value)
        if self._calls >= self.calls_per_step:
            self._flush_scalars()
        self.logger.commit_step()
        if self._calls == 1:
            self.publish_ready(metrics)

    def _flush_scalars(self) -> None:
        """The step's scalars once: the mean over its calls (a call past the announced ones adds no name again)."""
        scalars = {name: sum(v) / len(v) for name, v in self._scalars.items() if name not in self._flushed}
        self._scalars = {}
        self._flushed.update(scalars)
        if scalars and self._step is not None:
            self.logger.log_step(self._step, scalars=scalars)

    def update_actor(self, batch: Any) -> Any:
        """The trainer's ``_update_actor`` with the driver batch logged and stamped first (installed by attach)."""
        step, first_id, base, updates = self._begin_call(len(batch))
        log_driver_batch(self.logger, batch, step, getattr(self.trainer, "tokenizer", None), first_id=first_id,
                         update_base=base, updates=updates)
        try:
            output = self._update_actor(batch)
        finally:
            unstamp_batch(batch)
        metrics = output.meta_info.setdefault("metrics", {})
        self._end_call(step, metrics, actor_scalars(metrics))
        return output

    def _detach(self) -> None:
        """Restore the trainer's methods and verl's loss in the actors, which closes their loggers."""
        self.trainer.__dict__.pop("_update_actor", None)
        self.trainer.__dict__.pop("_save_checkpoint", None)
        if self.rejection is not None:
            self.rejection.remove()
        self.trainer.actor_rollout_wg.set_loss_fn(FinishActors(self.hook.inner, self.hook.logdir, self.hook.run_id))

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Restore the trainer's ``_update_actor``, close the actors' loggers (:class:`FinishActors`) and the
        driver's (its last step's scalars logged first)."""
        try:
            try:
                self._flush_scalars()
            finally:
                self._detach()
        finally:
            if self.alerts is not None:
                self.alerts.close()
            if status == "finished":
                self.logger.close()
            else:
                self.logger.close(status=status, error=error)

    def __enter__(self) -> VerlLogging:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(status="crashed", error=f"{exc_type.__name__}: {exc}")


def cfg_get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg.get(part, None) if hasattr(cfg, "get") else getattr(cfg, part, None)
        if cfg is None:
            return {}
    return cfg


class VerlV1Logging(VerlLogging):
    """:func:`attach` on verl's V1 trainer (``trainer.use_v1=True``, verl 0.9.1's default), whose
    ``_update_actor(batch, metrics)`` gets a TransferQueue ``KVBatchMeta``, ``parameter_sync_step`` times per
    global step (``PPOTrainer.step``). The driver reads the rows' response masks, advantages and rewards from
    TransferQueue for the ``samples`` table (their texts too with a tokenizer: never the log-probs), writes the
    sample and prompt ids and the trajectories' first and last versions into TransferQueue as more columns of the
    same rows (so each actor's micro-batch carries them, as the V0 trainer's batch does) and the step and update
    numbering into the batch's ``extra_info`` (verl hands it to the actors as non-tensor data); the actors' hook is
    the same."""

    def update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:  # type: ignore[override]
        """The trainer's ``_update_actor`` with the batch logged and stamped first (installed by attach)."""
        import transfer_queue as tq
        from tensordict import TensorDict

        tokenizer = getattr(self.trainer, "tokenizer", None)
        step, first_id, base, updates = self._begin_call(len(batch.keys))
        view = read_v1_batch(batch, text=tokenizer is not None)
        log_driver_batch(self.logger, view, step, tokenizer, first_id=first_id, update_base=base, updates=updates)
        versions = tag_versions(getattr(batch, "tags", None), len(batch.keys))
        if versions is not None:
            view.batch[VERSION_KEY], view.batch[VERSION_LAST_KEY] = versions
        keys = [k for k in ROW_KEYS if k in view.batch]
        stamps = TensorDict({k: view.batch[k] for k in keys}, batch_size=[len(batch.keys)])
        tq.kv_batch_put(keys=list(batch.keys), partition_id=batch.partition_id, fields=stamps)
        fields = list(batch.fields or [])
        batch.fields = fields + [k for k in keys if k not in fields]
        batch.extra_info.update(view.meta_info)
        try:
            output = self._update_actor(batch, metrics)
        finally:
            batch.fields = fields
            for key in META_KEYS:
                batch.extra_info.pop(key, None)
        self._end_call(step, metrics, {k: v for k, v in actor_scalars(metrics).items() if k.startswith(KEPT_SCALARS)})
        return output


def r3_routing_shape(model_path: Any) -> tuple[int, int, int] | None:
    """The ``routing_shape`` (MoE layers, top-k, experts) of the model verl trains, from its config (a local
    directory, or the Hugging Face cache), for a run whose rollouts return routed experts; None with a warning when
    the config cannot be read or names no experts (the experts are then not logged)."""
    from trustscope.routing import moe_shape

    try:
        from transformers import AutoConfig

        shape = moe_shape(AutoConfig.from_pretrained(str(model_path), trust_remote_code=False))
    except Exception as err:  # any loader error: the run goes on without the experts
        warnings.warn(f"rollout routing replay is on, but the config of {model_path!r} cannot be read ({err}): the "
                      f"routed experts are not logged; pass attach(..., routing_shape=(layers, top_k, experts))",
                      stacklevel=3)
        return None
    if shape is None:
        warnings.warn(f"rollout routing replay is on, but {model_path!r} is a dense model (its config names no "
                      f"experts): the routed experts are not logged", stacklevel=3)
    return shape


def attach(trainer: Any, logdir: str | os.PathLike, run_id: str | None = None, *, metrics: bool = True,
           webhook: str | None = None, warn_relative: float | None = None, **logger_options: Any) -> VerlLogging:
    """Log verl ``RayPPOTrainer`` ``trainer`` to ``<logdir>/<run_id>/``; call after ``init_workers()``.

    Both of verl 0.9.1's trainers: ``RayPPOTrainer`` (``trainer.use_v1=False``, ``main_ppo_v0``'s task runner; call
    after ``init_workers()``) and the V1 trainers of ``verl.trainer.ppo.v1`` (``trainer.use_v1=True``, the default;
    call after ``trainer.init()``), whose batch lives in TransferQueue (:class:`VerlV1Logging`).

    Wraps the trainer's ``_update_actor`` (the one place the driver batch goes to the actors) to log and stamp the
    batch, and installs :class:`ActorLogHook` around verl's ``ppo_loss`` in every actor through the worker group's
    ``set_loss_fn``. ``logger_options`` go to every :class:`~trustscope.logger.TokenLogger` (e.g.
    ``token_fraction``); ``strict`` defaults to False so bad rows are dropped with a warning, never an error in
    the middle of training. ``resume=True`` continues an existing run from the checkpoint verl restores
    (:meth:`VerlLogging.resume_at`).

    ``metrics`` (default True): a step's exact summaries over every actor's tokens (read from their committed
    files) and the collapse early warning go into verl's step metrics as ``trustscope/...``
    (:mod:`trustscope.trackers`, ``docs/trackers.md``) at the first actor update after every actor rank committed
    the step (usually the next step's; ``trustscope/step`` names the step they describe; the driver never waits
    for them), so verl's ``trainer.logger`` trackers carry them, and W&B or trackio among them get the early warning as an alert. ``webhook``: a Slack-compatible
    URL the early warning is posted to (:class:`trustscope.alerts.Alerts`); a malformed one raises ``ValueError``
    here. Both need a log directory the driver can read (local or shared). ``warn_relative``: the early warning in
    the run's own terms (:class:`trustscope.early_warning.WarningLines` ``relative_z`` robust deviations, and the relative
    detector); None keeps the absolute lines.
    """
    from trustscope.integrations.wiring import WarningWiring

    warning = WarningWiring.check(webhook, warn_relative)  # a bad value fails here, naming it
    version = verl_version()
    check_release(version)
    require_attrs(trainer, f"trainer {type(trainer).__name__}", ("_update_actor", "config", "global_steps"))
    params = list(inspect.signature(trainer._update_actor).parameters)
    v1 = params == ["batch", "metrics"]  # verl's V1 trainer: the batch is a KVBatchMeta into TransferQueue
    if not v1 and params != ["batch"]:
        raise NotImplementedError(
            f"attach() logs verl's RayPPOTrainer (_update_actor(batch), trainer.use_v1=False) and its V1 trainer "
            f"(_update_actor(batch, metrics), trainer.use_v1=True); {type(trainer).__name__}._update_actor"
            f"{tuple(params)} is neither (verl {version}): run with trainer.use_v1=False, or build a RayPPOTrainer"
        )
    if v1:
        need("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
        if importlib.util.find_spec("transfer_queue") is None:
            raise ImportError("verl's V1 trainer keeps its batch in TransferQueue, which is not installed: pip "
                              "install transferqueue==0.1.11 (verl's verl-core extra), or run with "
                              "trainer.use_v1=False")
    if not hasattr(trainer, "actor_rollout_wg"):
        raise RuntimeError("attach() sends its hook to the trainer's actor workers: call trainer.init_workers() first")
    require_attrs(trainer.actor_rollout_wg, "the actor worker group", ("set_loss_fn",))
    check_loop(trainer, v1)
    ppo_loss = need("verl.workers.utils.losses", "ppo_loss")
    omega_conf_to_dataclass = need("verl.utils.config", "omega_conf_to_dataclass")
    cfg = trainer.config
    if cfg.get("distillation", None) and cfg.distillation.get("enabled", False):
        raise NotImplementedError("trustscope's verl hook wraps verl's ppo_loss; distillation runs use another loss")
    actor_cfg = cfg.actor_rollout_ref.actor
    layout = check_actor_config(actor_cfg)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    loss_mode = str(actor_cfg.policy_loss.get("loss_mode", "vanilla"))
    rule = rule_of_loss_mode(loss_mode)
    has_mu = bool(rollout_cfg.get("calculate_log_probs", False))
    bypass = bool((cfg.algorithm.get("rollout_correction", None) or {}).get("bypass_mode", False))
    if not has_mu:
        warnings.warn("verl keeps no rollout log-probs (actor_rollout_ref.rollout.calculate_log_probs=False): mu is "
                      "logged as the actor's recompute old_log_probs (mu_source='trainer_recompute'), so mismatch "
                      "will read zero; set calculate_log_probs=True to measure it", stacklevel=2)
    verl_mask = VERL_MASKS.get(loss_mode) if rule is None else None
    if rule is None and verl_mask is None:
        warnings.warn(f"loss_mode {loss_mode!r} is verl's own and masks trustscope cannot replay (it replays "
                      f"{sorted(VERL_MASKS)}), so 'kept' is logged True on every token (the counterfactual views "
                      f"still replay every trustscope rule)", stacklevel=2)
    resume = bool(logger_options.pop("resume", False))  # the driver resumes; the actors open theirs resumed
    options = {"strict": False, **logger_options}
    if rollout_cfg.get("enable_rollout_routing_replay", False) and options.get("routing_shape") is None:
        options["routing_shape"] = r3_routing_shape(cfg.actor_rollout_ref.model.get("path", None))
    summary = {
        "loss_mode": loss_mode,
        "loss_agg_mode": actor_cfg.get("loss_agg_mode", None),
        "ppo_epochs": actor_cfg.get("ppo_epochs", None),
        "rollout_n": rollout_cfg.get("n", None),
        "calculate_log_probs": has_mu,
        "bypass_mode": bypass,
        "rule_mu": "rollout_log_probs" if has_mu else "old_log_probs",
        "kept": ("the rule's mask" if rule is not None else f"verl's {loss_mode} mask, replayed" if verl_mask
                 else f"not recorded (verl's {loss_mode} loss)"),
        "ranks": "0: driver (samples, steps); r + 1: data-parallel replica r of the actors (tokens)",
        "actor_layout": layout,
        "parameter_sync_step": int(getattr(trainer, "parameter_sync_step", 1) or 1) if v1 else 1,
        "rollout_rs": (cfg.algorithm.get("rollout_correction", None) or {}).get("rollout_rs", None),
    }
    logger = TokenLogger(
        logdir, run_id, rank=0,
        config={"verl": summary, "config": _to_plain(cfg)},
        model={"path": cfg.actor_rollout_ref.model.get("path", None)},
        sampling={k: rollout_cfg.get(k, None) for k in ("name", "temperature", "top_p", "top_k", "n")},
        vocab=getattr(trainer, "tokenizer", None),
        loss_rule=rule or f"verl:{loss_mode}",
        mu_source="engine" if has_mu else "trainer_recompute",
        source={"framework": "verl", "version": version},
        resume=resume,
        **options,
    )
    actor_config = omega_conf_to_dataclass(actor_cfg)
    hook = ActorLogHook(partial(ppo_loss, config=actor_config), logdir, logger.run_id,
                        loss_rule=rule or f"verl:{loss_mode}", log_old_logprob=not bypass,
                        mask_fn=partial(verl_mask, config=actor_config) if verl_mask else None,
                        logger_options=options, own_is_weights=rule is None)
    trainer.actor_rollout_wg.set_loss_fn(hook)
    loggers = cfg.trainer.get("logger", None)  # verl's trackers: W&B / trackio get the warning as an alert
    reporter, alerts = warning.build(logger, loggers if isinstance(loggers, str) else list(loggers or []),
                                     metrics=metrics)
    correction = cfg.algorithm.get("rollout_correction", None) or {}
    rejection = RejectionMask(trainer, v1) if correction.get("rollout_rs", None) and not bypass else None
    handle = (VerlV1Logging if v1 else VerlLogging)(
        trainer, logger, hook, trainer._update_actor, reporter, alerts, resume=resume, rejection=rejection,
        calls_per_step=int(getattr(trainer, "parameter_sync_step", 1) or 1) if v1 else 1)
    trainer._update_actor = handle.update_actor
    return handle
