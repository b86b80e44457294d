""":func:`attach`: the logger, the hooks, the callback and the warning wiring put on one ``GRPOTrainer``;
:class:`Attachment` holds them for the run."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trustscope.alerts import Alerts
from trustscope.capture import logprobs_from_hidden, top_k_from_hidden
from trustscope.columns import turns_from_mask
from trustscope.divergence import force_sampled_into_topk
from trustscope.integrations.trl.engine import EngineCall, engine_rows
from trustscope.integrations.trl.hooks import (
    _ENGINE_IDS,
    _MU_RECOMPUTE,
    _POLICY_VERSION,
    _PROMPT_ID,
    _REWARD,
    _SAMPLE_ID,
    _TOPK_IDS,
    _TOPK_LOGPROBS,
    _backbone,
    _full,
    _gathered,
    _head_module,
    _Hooks,
    _logit_transform,
    _pad_rows,
    _rows,
)
from trustscope.integrations.trl.settings import trl_kept, trl_settings
from trustscope.integrations.trl.versions import (
    TESTED_TRL,
    TRLVersionError,
    check_trainer,
)
from trustscope.integrations.wiring import WarningWiring
from trustscope.logger import LogWarning, TokenLogger
from trustscope.trackers import StepReporter


class Attachment:
    """What :func:`attach` returns: the trainer, its :class:`~trustscope.logger.TokenLogger` (``logger``) and the
    installed hooks. :meth:`detach` removes the hooks and closes the log (done at the end of ``train()``)."""

    def __init__(self, trainer: Any, logger: TokenLogger, topk: int, topk_forward: bool,
                 reporter: StepReporter | None = None, alerts: Alerts | None = None):
        self.trainer = trainer
        self.logger = logger
        self.reporter = reporter
        """Adds the step summaries to TRL's logged metrics (None: ``metrics=False``)."""
        self.alerts = alerts
        self.topk = topk
        self.topk_forward = topk_forward
        self.active = True
        self.hooks = _Hooks(self)
        self.engine_logprobs: int | None = None  # vLLM's logprobs setting before attach raised it to topk
        self._rollouts = 0  # completions tagged so far, over all ranks
        self._unscored = 0  # tokens left out since the last scalars were written
        self._scalar_step: int | None = None
        self._scalar_names: set[str] = set()  # scalar names written at _scalar_step
        self._warned: set[str] = set()
        self.resume = bool(logger.manifest.get("resumes"))
        """A resumed run, not yet cut back to TRL's restored step (at ``on_train_begin``)."""

    def resume_at(self, step: int) -> int:
        """TRL resumes at ``step`` (``state.global_step`` once ``resume_from_checkpoint`` loaded): this rank's rows
        after ``step - 1`` go, so the resumed steps are logged once
        (:meth:`~trustscope.logger.TokenLogger.cut_back`). The main process also cuts back the ranks no process
        of this session writes (a resume on fewer processes) and counts a resume on another number of processes;
        a log that ends before the checkpoint is counted too, never a reason to stop (logging incidents,
        :mod:`trustscope.runformat.incidents`). Returns the files removed."""
        self.resume = False
        accelerator = self.trainer.accelerator
        if getattr(accelerator, "is_main_process", True):
            return self.logger.cut_back(step - 1, world=int(accelerator.num_processes))
        return self.logger.cut_back(step - 1)

    def detach(self) -> None:
        """Remove the hooks and close the log. Safe to call twice."""
        if not self.active:
            return
        self.active = False
        self.hooks.remove()
        if self.engine_logprobs is not None:  # TRL reads lp[0] as the sampled token's only with logprobs=0
            self.trainer.vllm_generation.logprobs = self.engine_logprobs
        if self.alerts is not None:
            self.alerts.close()
        self.logger.close()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"trustscope: {message}", LogWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------------------ rollout side

    def tag_rollout(self, out: dict[str, Any], rewards_global: Tensor | None,
                    engine_calls: list[EngineCall] | None = None) -> None:
        """Add sample ids, prompt groups, weighted rewards, the engine's ids and mu's top-K to TRL's batch (rows
        stay aligned when TRL shuffles and splits it)."""
        t = self.trainer
        ids = out["completion_ids"]  # (B, T)
        B, T = ids.shape
        rank, world = t.accelerator.process_index, t.accelerator.num_processes
        first = self._rollouts + rank * B
        rows = torch.arange(first, first + B, device=ids.device)  # (B,) global completion index
        out[_SAMPLE_ID] = rows
        out[_PROMPT_ID] = rows // t.num_generations  # TRL repeats each prompt num_generations times in a row
        out[_POLICY_VERSION] = torch.full((B,), self.weights_version(), dtype=torch.long, device=ids.device)
        self._rollouts += world * B
        if rewards_global is not None:
            local = rewards_global[rank * B : (rank + 1) * B]  # (B, F), TRL's process slice
            w = t.reward_weights.to(local.device)
            reward = (local * w).nansum(dim=1)  # (B,) TRL's weighted reward
            reward[torch.isnan(local).all(dim=1)] = torch.nan  # unscorable: TRL logs NaN too
            out[_REWARD] = reward.to(ids.device)
        engine_topk = self._tag_engine_ids(out, engine_calls) if engine_calls else None
        if not self.topk:
            return
        if engine_topk is not None:
            out[_TOPK_IDS] = _pad_rows(engine_topk[0], T, self.topk, 0, torch.long, ids.device)  # (B, T, K)
            out[_TOPK_LOGPROBS] = _pad_rows(engine_topk[1], T, self.topk, math.nan, torch.float32, ids.device)
        elif self.topk_forward:
            self._rollout_forward(out)

    def weights_version(self) -> int:
        """The step whose weights generate the rollout being tagged: on the vLLM path the step whose weights TRL
        last loaded into the engine (``_last_loaded_step``: TRL syncs them before a rollout whenever
        ``global_step`` moved), else ``global_step`` (the transformers path samples from the model in training)."""
        t = self.trainer
        loaded = getattr(t, "_last_loaded_step", None) if t.use_vllm else None
        if isinstance(loaded, int) and loaded >= 0:
            return loaded
        return int(t.state.global_step)

    def update_index(self) -> int:
        """Which optimizer update since the rollout this micro-batch trains: TRL generates once every
        ``steps_per_generation * num_iterations`` micro-batches (``_step``, the micro-batches trained so far) and
        makes one update every ``gradient_accumulation_steps`` of them, so it is ``(_step mod generate_every) //
        gradient_accumulation_steps``: iteration x ``steps_per_generation`` + slice when each update is one
        micro-batch. After a resume TRL counts ``_step`` from 0 and generates anew, and so does this."""
        t = self.trainer
        every = int(t.args.steps_per_generation) * int(t.args.num_iterations)
        return (int(t._step) % every) // max(int(t.args.gradient_accumulation_steps), 1)

    def _tag_engine_ids(self, out: dict[str, Any], calls: list[EngineCall]) -> tuple[list, list] | None:
        """The engine's id at each completion position (``(B, T)``, -1 where none) into the batch, from the
        rollout's engine calls (:func:`engine_rows`: with tool calls, each model turn from the call that sampled
        it); returns mu's top-K per completion when the calls have it."""
        completions = _rows(out["completion_ids"], out["completion_mask"])
        tool = _rows(out["tool_mask"], out["completion_mask"]) if "tool_mask" in out else None
        ids, topk = engine_rows(calls, _rows(out["prompt_ids"], out["prompt_mask"]), completions, tool, self.topk)
        B, T = out["completion_ids"].shape
        table = torch.full((B, T), -1, dtype=torch.long)
        for i, row in enumerate(ids):
            if row:
                table[i, : len(row)] = torch.tensor(row[:T], dtype=torch.long)
        out[_ENGINE_IDS] = table.to(out["completion_ids"].device)
        return topk

    @torch.no_grad()
    def _rollout_forward(self, out: dict[str, Any]) -> None:
        """The trainer's own top-K (and sampled-token log-prob) at the rollout's weights: one no-grad forward of the
        backbone, then one pass over the LM head's rows in tiles (:func:`~trustscope.capture.top_k_from_hidden`:
        no ``(B, T, V)`` logits)."""
        t = self.trainer
        model = _head_module(t.accelerator.unwrap_model(t.model))
        head = model.get_output_embeddings()
        scale, softcap = _logit_transform(model)
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)  # (B, P + T)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)  # (B, P + T)
        T = out["completion_ids"].shape[1]
        step = t.args.per_device_train_batch_size
        ids, lps, mu = [], [], []
        for start in range(0, input_ids.shape[0], step):
            sl = slice(start, start + step)
            hidden = _backbone(model)(input_ids=input_ids[sl], attention_mask=attention[sl]).last_hidden_state
            with _gathered(head.weight, head.bias):
                weight, bias = _full(head.weight), _full(head.bias)
                k_ids, k_lps, lp = top_k_from_hidden(
                    hidden[:, -(T + 1):-1].to(weight.device), weight, self.topk, bias=bias,
                    label_ids=out["completion_ids"][sl].to(weight.device), temperature=t.temperature,
                    logit_scale=scale, softcap=softcap)  # column t predicts completion token t
            ids.append(k_ids)
            lps.append(k_lps)
            mu.append(lp)
        device = out["completion_ids"].device
        out[_TOPK_IDS], out[_TOPK_LOGPROBS], out[_MU_RECOMPUTE] = (torch.cat(x).to(device) for x in (ids, lps, mu))

    # --------------------------------------------------------------------------------------------------- loss side

    def log_micro_batch(self, inputs: Mapping[str, Any], pi: Tensor, entropy: Tensor | None,
                        hidden: tuple[Tensor, torch.dtype] | None = None) -> None:
        """Log one micro-batch of TRL's loss: its tokens, mu, pi, entropy, advantages and applied mask (and, with
        top-K, pi at mu's ids from the loss forward's last hidden states ``hidden``: ``(B, L, H)`` and the dtype
        of the head's matmul)."""
        t = self.trainer
        if _SAMPLE_ID not in inputs:
            self._warn_once("untagged", "a batch generated before attach() was not logged")
            return
        completion = inputs["completion_ids"]  # (B, T)
        if pi.shape != completion.shape:
            raise TRLVersionError(f"the loss forward's log-probs have shape {tuple(pi.shape)}, the completions "
                                  f"{tuple(completion.shape)}; TRL {TESTED_TRL} scores every completion token")
        loss_mask = inputs["completion_mask"]  # (B, T)
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        engine = inputs.get("sampling_per_token_logps")
        if self.logger.mu_source == "engine":
            if engine is None:
                self._warn_once("no-engine", "mu_source is 'engine' but TRL's batch holds no "
                                "sampling_per_token_logps (a rollout_func without logprobs?): batch not logged")
                return
            mu = engine
        else:
            mu = old if old is not None else inputs.get(_MU_RECOMPUTE, pi)
        kept = self._kept(inputs, pi, entropy, loss_mask)  # (B, T)
        mask = loss_mask.bool() & torch.isfinite(mu) & torch.isfinite(pi)  # (B, T)
        tokens: dict[str, Any] = {"token_id": completion, "mu_logprob": torch.nan_to_num(mu), "pi_logprob": pi,
                                  "advantage": inputs["advantages"], "kept": kept}
        if entropy is not None:
            tokens["entropy"] = entropy
        if _POLICY_VERSION in inputs:  # (B,): the step whose weights generated each completion
            tokens["policy_version"] = inputs[_POLICY_VERSION]
            tokens["update_index"] = torch.full_like(inputs[_POLICY_VERSION], self.update_index(), dtype=torch.int32)
        if old is not None:
            tokens["old_logprob"] = torch.nan_to_num(old)
        if "tool_mask" in inputs:  # tool calls: each tool result (0 in tool_mask) starts the model's next turn
            tokens["turn"] = turns_from_mask(inputs["tool_mask"].bool().cpu().numpy())
        if _TOPK_IDS in inputs:
            mu_ids, mu_lps = force_sampled_into_topk(inputs[_TOPK_IDS], inputs[_TOPK_LOGPROBS], completion.long(),
                                                     mu.float())
            mask &= torch.isfinite(mu_lps).all(-1)
            tokens["mu_topk_ids"] = mu_ids
            tokens["mu_topk_logprobs"] = torch.nan_to_num(mu_lps)
            tokens["pi_topk_logprobs"] = self._pi_topk(inputs, mu_ids, pi, hidden)
        if _ENGINE_IDS in inputs:  # the vLLM path: the ids the engine returned, each turn from its own call
            engine_ids = inputs[_ENGINE_IDS]
            if bool(((engine_ids < 0) & mask).any()):
                self._warn_once("engine-ids", "some completion tokens have no engine id (a model turn no engine call "
                                "returned): engine_token_id is left out of those batches")
            else:
                tokens["engine_token_id"] = engine_ids
        self._unscored += int((loss_mask.bool() & ~mask).sum())
        self.logger.log_step(t.state.global_step, tokens=tokens, mask=mask,
                             samples=self._samples(inputs))

    def _kept(self, inputs: Mapping[str, Any], pi: Tensor, entropy: Tensor | None, loss_mask: Tensor) -> Tensor:
        """TRL's applied mask: the clip region (:func:`trl_kept`) and, when on, TRL's own off-policy,
        high-entropy and vLLM importance-sampling masks, computed by TRL's own methods on the same tensors."""
        t = self.trainer
        old = inputs.get("old_per_token_logps")
        old = pi if old is None else old
        keep = trl_kept(pi, old, inputs["advantages"], loss_mask, loss_type=t.loss_type,
                        epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high, delta=t.args.delta,
                        importance_sampling_level=t.importance_sampling_level)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        if t.off_policy_mask_threshold is not None:
            keep = keep & t.get_off_policy_mask(
                advantages=advantages, per_token_logps=pi,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=loss_mask,
                off_policy_threshold=t.off_policy_mask_threshold).bool()
        if t.top_entropy_quantile < 1.0 and entropy is not None:
            keep = keep & t.get_high_entropy_mask(entropy, loss_mask, 1 - t.top_entropy_quantile)
        if t.use_vllm and t.vllm_importance_sampling_correction and t.loss_type != "vespo":
            keep = keep & (inputs["importance_sampling_ratio"] > 0)
        return keep

    @torch.no_grad()
    def _pi_topk(self, inputs: Mapping[str, Any], mu_ids: Tensor, pi: Tensor,
                 hidden: tuple[Tensor, torch.dtype] | None) -> Tensor:
        """pi's log-probs at mu's top-K ids ``(B, T, K)`` from the loss forward: its last hidden states, the LM
        head's rows at the ids, and log Z from ``pi``, TRL's log-prob of each completion token (same temperature)."""
        model = _head_module(self.trainer.accelerator.unwrap_model(self.trainer.model))
        if hidden is None:
            raise TRLVersionError(f"the loss forward did not run the backbone of {type(model).__name__}, as TRL "
                                  f"{TESTED_TRL}'s fused LM head does; trustscope cannot score mu's top-K ids")
        states, dtype = hidden
        completion = inputs["completion_ids"]  # (B, T)
        T = completion.shape[1]
        if states.shape[0] != completion.shape[0] or states.shape[1] <= T:
            raise TRLVersionError(f"the loss forward's hidden states have shape {tuple(states.shape)}, the "
                                  f"completions {tuple(completion.shape)}; TRL {TESTED_TRL} runs prompt + completion")
        head = model.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        scale, softcap = _logit_transform(model)
        # a token whose pi is not finite is left out of the log (log_micro_batch's mask); any finite stand-in keeps
        # the call's check on the label's log-prob for the tokens that are logged
        label_lp = torch.where(torch.isfinite(pi), pi, torch.zeros_like(pi))  # (B, T)
        with _gathered(weight, bias):
            weight, bias = _full(weight), _full(bias)
            return logprobs_from_hidden(states[:, -(T + 1):-1].to(weight.device), weight, mu_ids.to(weight.device),
                                        bias=bias, label_ids=completion.to(weight.device),
                                        label_logprobs=label_lp.to(weight.device),
                                        temperature=self.trainer.temperature, logit_scale=scale, softcap=softcap,
                                        matmul_dtype=dtype).to(pi.device)

    def _samples(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The micro-batch's samples rows: ids, prompt group, texts, finish reason, advantage, weighted reward."""
        t = self.trainer
        prompts = _rows(inputs["prompt_ids"], inputs["prompt_mask"])
        responses = _rows(inputs["completion_ids"], inputs["completion_mask"])
        eos = set(getattr(t, "eos_token_ids", None) or [t.processing_class.eos_token_id])  # a list from TRL 1.15
        samples: dict[str, Any] = {  # texts: decoded by the logger's writer thread, for its text_fraction sample
            "sample_id": inputs[_SAMPLE_ID], "prompt_id": inputs[_PROMPT_ID],
            "prompt_token_ids": prompts, "response_token_ids": responses,
            "finish_reason": ["stop" if r and r[-1] in eos else "length" for r in responses],
        }
        if inputs["advantages"].dim() == 1:
            samples["advantage"] = inputs["advantages"]
        reward = inputs.get(_REWARD)
        if reward is not None:
            if torch.isfinite(reward).all():
                samples["reward"] = reward
            else:
                self._warn_once("nan-reward", "a batch with unscorable completions (every reward function returned "
                                "None) is logged without rewards")
        return samples

    # ------------------------------------------------------------------------------------------------- callbacks

    def on_log(self, step: int, logs: Mapping[str, Any]) -> None:
        """TRL's logged numbers as ``trl/<name>`` scalars at ``step`` (a name TRL logs twice at one step, as
        ``epoch`` in the end-of-training summary, keeps its first value)."""
        if not self.active:
            return
        if step != self._scalar_step:
            self._scalar_step, self._scalar_names = step, set()
        scalars = {f"trl/{k}": float(v) for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and f"trl/{k}" not in self._scalar_names
                   and not k.startswith("trustscope/")}  # the step summaries attach added: already in the log
        self._scalar_names.update(scalars)
        if self._unscored:
            scalars["trustscope/unscored_tokens"] = float(self._unscored)
            self._unscored = 0
        if scalars:
            self.logger.log_step(step, scalars=scalars)


def _callback(attachment: Attachment) -> Any:
    from transformers import TrainerCallback

    class TrustscopeCallback(TrainerCallback):
        """Cuts a resumed run back to TRL's restored step, flushes before a checkpoint, writes TRL's logged
        metrics as scalars and closes the trustscope log when training ends."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # after TRL restored a checkpoint (resume_from_checkpoint): global_step is the first step to train
            if attachment.resume:
                attachment.resume_at(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if control.should_save and not control.should_log:
                attachment.logger.flush()  # the checkpoint that follows finds its steps in the log

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> None:
            # TRL logs after the optimizer step: global_step has moved past the step the numbers describe
            attachment.on_log(max(state.global_step - 1, 0), logs or {})
            if control.should_save:
                attachment.logger.flush()  # the checkpoint that follows finds its steps in the log

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            attachment.detach()

    return TrustscopeCallback()


def attach(trainer: Any, logdir: str, topk: int = 0, *, topk_forward: bool = False, metrics: bool = True,
           metrics_wait_s: float = 1.0, webhook: str | None = None, warn_relative: float | None = None,
           **logger_options: Any) -> Attachment:
    """Log ``trainer`` (a TRL ``GRPOTrainer``) to ``logdir`` with trustscope. Call before ``trainer.train()``.

    Args:
        trainer: a ``trl.GRPOTrainer`` of TRL :data:`SUPPORTED_TRL` (checked: :func:`check_trainer`).
        logdir: the log directory; the run is ``<logdir>/<run_id>/``.
        topk: log mu's top-K ids and log-probs and pi's at the same ids (0: none). On the vLLM path the engine
            reports them; on the transformers path it needs ``topk_forward=True``. pi's log-probs at the ids come
            from the loss forward's last hidden states and K rows of the LM head (no extra forward, no logits).
        topk_forward: on the transformers path, stand the trainer's own top-K at the rollout's weights in for
            the engine's (one more no-grad forward per rollout). Ignored with vLLM.
        metrics: add the latest step's exact summaries, as ``trustscope/...`` metrics
            (:mod:`trustscope.trackers`, ``docs/trackers.md``), with the collapse early warning, to the metrics
            TRL logs, so every ``report_to`` tracker carries them (this process's tokens: with several
            processes, the main one's share).
        metrics_wait_s: how long TRL's ``log`` may wait for the logger's writer thread to summarise the step
            (0: never; the metrics are then those of the newest step it has summarised, ``trustscope/step``).
        webhook: a Slack-compatible webhook URL the early warning is posted to (:class:`trustscope.alerts.Alerts`,
            on a background thread); a malformed URL raises ``ValueError`` here. With ``report_to`` W&B or trackio
            the warning is also an alert there (``wandb.alert``, ``trackio.alert``), webhook or not.
        warn_relative: the early warning in the run's own terms (:class:`trustscope.early_warning.WarningLines`
            ``relative_z``): its lines that many robust deviations above the run's first steps, and the relative
            detector; None (the default) keeps the absolute lines and detector.
        **logger_options: passed to :class:`~trustscope.logger.TokenLogger` (``run_id``, ``token_fraction``,
            ``strict``, ...). Defaults set here: ``loss_rule="trl:<loss_type>"``, ``mu_source`` as the module
            docstring says, ``source``, ``sampling``, ``model``, ``tokenizer``, ``vocab``, ``rank`` (the
            accelerator's process index), and ``strict=False`` (a bad row is dropped with a warning rather than
            stopping the training). A given ``config`` is stored beside TRL's settings.

    Returns:
        :class:`Attachment` (``.logger`` is the run's logger; ``.detach()`` undoes attach early).
    """
    import trl

    check_trainer(trainer)
    warning = WarningWiring.check(webhook, warn_relative)  # a bad value fails here, naming it
    if isinstance(metrics_wait_s, bool) or not isinstance(metrics_wait_s, int | float) \
            or not 0 <= metrics_wait_s < math.inf:
        raise ValueError(f"metrics_wait_s must be a finite number of seconds >= 0, got {metrics_wait_s!r}")
    if "compute_loss" in vars(trainer):
        raise ValueError("this trainer already has an attachment (or another wrapper of compute_loss); attach once "
                         "per trainer, or detach() the first")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(f"topk must be an int >= 0, got {topk!r}")
    engine_logprobs = trainer.use_vllm or trainer.rollout_func is not None
    if topk and not trainer.use_vllm:
        if trainer.rollout_func is not None:
            raise ValueError("topk with a rollout_func: TRL's rollout_func returns no top-K; use topk=0")
        if not topk_forward:
            raise ValueError(f"topk={topk} on TRL's transformers path (use_vllm=False) has no engine top-K to read; "
                             f"pass topk_forward=True to recompute it with one extra forward per rollout (a "
                             f"recompute, like mu on this path), or topk=0")
    if topk and trainer.use_vllm:
        config = getattr(getattr(getattr(trainer.vllm_generation, "llm", None), "llm_engine", None), "model_config",
                         None)
        most = getattr(config, "max_logprobs", None)  # colocate mode; a server checks its own
        if most is not None and 0 <= most < topk:
            raise ValueError(f"topk={topk} exceeds the colocated vLLM engine's max_logprobs={most} (TRL starts it "
                             f"with vLLM's default); use topk <= {most}")
    if topk:
        _backbone(trainer.accelerator.unwrap_model(trainer.model))  # pi's top-K reads its hidden states
    mu_source = logger_options.pop("mu_source", "engine" if engine_logprobs else "trainer_recompute")
    if mu_source == "trainer_recompute":
        warnings.warn("trustscope: TRL keeps no rollout log-probs without vLLM (use_vllm=False), so mu is the "
                      "trainer's own recompute (mu_source='trainer_recompute'): training-inference mismatch will "
                      "read zero and the dashboard cannot compare anchoring to mu against pi_old",
                      LogWarning, stacklevel=2)
    settings = trl_settings(trainer)
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    model = trainer.accelerator.unwrap_model(trainer.model)
    options: dict[str, Any] = {
        "loss_rule": f"trl:{trainer.loss_type}",
        "source": {"framework": "trl", "version": trl.__version__},
        "sampling": {"engine": "vllm" if trainer.use_vllm else "transformers",
                     **{k: settings[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
                     "max_tokens": settings["max_completion_length"], "logprobs": topk,
                     "logprobs_mode": "processed_logprobs" if trainer.use_vllm else None},
        "model": {"name": getattr(model, "name_or_path", type(model).__name__)},
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", type(tokenizer).__name__)},
        "vocab": tokenizer,
        "rank": trainer.accelerator.process_index,
        "strict": False,
    }
    user_config = logger_options.pop("config", None)
    options.update(logger_options)
    options["config"] = {"trl": settings, **({"user": dict(user_config)} if user_config else {})}
    logger = TokenLogger(logdir, mu_source=mu_source, **options)
    main = getattr(trainer.accelerator, "is_main_process", True)
    reporter, alerts = warning.build(logger, getattr(trainer.args, "report_to", None), metrics=metrics,
                                     posts=main, wait_s=metrics_wait_s)  # one process posts; W&B / trackio alerts
    attachment = Attachment(trainer, logger, topk, topk_forward and not trainer.use_vllm, reporter, alerts)
    if trainer.use_vllm and topk:
        attachment.engine_logprobs = trainer.vllm_generation.logprobs
        trainer.vllm_generation.logprobs = topk
    attachment.hooks.install(trainer)
    trainer.add_callback(_callback(attachment))
    return attachment
