"""The actors' side: verl's ``ppo_loss`` with trustscope's mu provision and token logging around it.

Each actor process of data-parallel rank r logs, as trustscope rank r + 1, the ``tokens`` rows of every micro-batch
its replica trains on, once per update: a response trained by several updates of a step (``ppo_epochs > 1``, or a
V1 step of several ``_update_actor`` calls) has rows in each, told apart by ``update_index``. The update of a
micro-batch is the call's first update (:data:`~trustscope.integrations.verl.driver.UPDATE_BASE_KEY`, stamped by
the driver) plus the index of its mini-batch in verl's ``train_mini_batch`` loop (epochs x mini-batches), counted
from the rows this rank has trained in the call and verl's own ``global_batch_size`` and ``dp_size``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from trustscope.columns import turns_from_mask
from trustscope.integrations.verl.driver import (
    BATCH_SIZE_KEY,
    PROMPT_KEY,
    REJECTED_KEY,
    SAMPLE_KEY,
    STEP_KEY,
    UPDATE_BASE_KEY,
    UPDATES_KEY,
    VERSION_KEY,
    VERSION_LAST_KEY,
)
from trustscope.integrations.verl.layout import ActorLayout, actor_layout
from trustscope.integrations.verl.losses import ACTOR_CALL, ActorCall
from trustscope.integrations.verl.versions import SUPPORTED_VERL, VerlVersionError, need, verl_version
from trustscope.logger import TokenLogger


class VerlUpdateMismatch(ValueError):
    """Two updates of one step trained a response with different tokens or masks (named: step, update, field)."""


OPTIONAL_FIELDS = ("rollout_log_probs", "rollout_is_weights", VERSION_KEY, VERSION_LAST_KEY, REJECTED_KEY)


class ActorLogHook:
    """verl actor loss function: verl's ``ppo_loss`` with trustscope's mu provision and token logging around it.

    verl calls it as ``loss_fn(model_output=..., data=micro_batch, dp_group=...)`` (its engines' ``forward_step``).
    A micro-batch without the driver's step stamp (another caller of the loss) passes straight through. Sent to the
    actors by :func:`~trustscope.integrations.verl.attach` through verl's ``set_loss_fn``; it is pickled, and each
    process opens its own logger. ``kept`` is the trustscope rule's mask; with verl's own loss it is
    ``mask_fn(log_prob, old_log_prob, advantages)`` (a replay, :data:`~trustscope.integrations.verl.VERL_MASKS`), or
    ``response_mask`` without one; in every case False on the tokens rollout rejection sampling took out.
    """

    def __init__(self, inner: Callable[..., Any], logdir: str | os.PathLike, run_id: str, *, loss_rule: str,
                 log_old_logprob: bool = True, mask_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                 logger_options: Mapping[str, Any] | None = None, own_is_weights: bool = False):
        self.inner = inner
        self.mask_fn = mask_fn
        self.logdir = str(logdir)
        self.run_id = run_id
        self.loss_rule = loss_rule
        self.log_old_logprob = log_old_logprob
        self.logger_options = dict(logger_options or {})
        self.own_is_weights = own_is_weights
        """verl's own loss (not a trustscope rule): it multiplies ``rollout_is_weights`` into every token's loss."""
        self._reset()

    _STATE = ("_logger", "_call", "_rows", "_share_done", "_layout", "_shapes")

    def _reset(self) -> None:
        self._logger: TokenLogger | None = None
        self._call: tuple[int, int] | None = None  # (step, first update) of the open _update_actor call
        self._rows = 0  # rows this rank logged in the open call
        self._share_done = True  # this rank's share of the open call is all logged (and committed)
        self._layout: ActorLayout | None = None
        self._shapes: dict[int, tuple[int, int, int]] = {}  # sample id -> (update, tokens, token id sum) of the call

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in self._STATE:
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __call__(self, model_output: Mapping[str, Any], data: Any, dp_group: Any = None) -> Any:
        get = need("verl.utils.tensordict_utils", "get_non_tensor_data")
        step = get(data=data, key=STEP_KEY, default=None)
        if step is None:
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)
        layout = self._layout_of(dp_group)
        fields = ["responses", "response_mask", "old_log_probs", "advantages", SAMPLE_KEY, PROMPT_KEY]
        missing = [f for f in fields if f not in data]
        if missing:
            raise KeyError(f"verl micro-batch of step {step} has no {missing}; the driver stamps {SAMPLE_KEY} and "
                           f"{PROMPT_KEY} (trustscope.integrations.verl.attach)")
        fields += [f for f in OPTIONAL_FIELDS if f in data]
        cols = data.select(*fields).to_padded_tensor()
        call = ActorCall(mu=cols.get("rollout_log_probs", None))
        token = ACTOR_CALL.set(call)
        try:
            result = self.inner(model_output=model_output, data=data, dp_group=dp_group)
        finally:
            ACTOR_CALL.reset(token)
        if layout.logs:  # one rank per data-parallel replica holds its gathered rows
            with torch.no_grad():
                self._log(int(step), model_output, data, cols, call, layout.dp_rank + 1)
        return result

    def _layout_of(self, dp_group: Any) -> ActorLayout:
        """This process's :class:`ActorLayout`, read at its first micro-batch (before anything is logged)."""
        if self._layout is None:
            self._layout = actor_layout(dp_group)
        return self._layout

    def _update_of(self, data: Any, step: int) -> tuple[int, int, int]:
        """The open call's first update, this micro-batch's update, and the rows this rank trains in the call."""
        get = need("verl.utils.tensordict_utils", "get_non_tensor_data")
        values = {}
        for key in (UPDATE_BASE_KEY, UPDATES_KEY, BATCH_SIZE_KEY, "global_batch_size", "dp_size"):
            value = get(data=data, key=key, default=None)
            if value is None:
                raise VerlVersionError(f"verl {verl_version()}: the actor's micro-batch of step {step} has no "
                                       f"{key!r}, from which trustscope numbers the updates of a step; "
                                       f"trustscope.integrations.verl supports verl {SUPPORTED_VERL}")
            values[key] = int(value)
        base, updates, dp = values[UPDATE_BASE_KEY], values[UPDATES_KEY], max(values["dp_size"], 1)
        per_update = max(values["global_batch_size"] // dp, 1)  # rows of one mini-batch on this rank
        if (step, base) != self._call:
            if self._logger is not None and not self._share_done:
                self._logger.commit_step()  # a share smaller than announced: the call ends here
            self._call, self._rows, self._share_done, self._shapes = (step, base), 0, False, {}
        index = self._rows // per_update
        if index >= updates:
            raise VerlUpdateMismatch(f"step {step}, update {base + index}: this rank trained {self._rows} rows of "
                                     f"the call before this micro-batch, more than its {updates} update(s) of "
                                     f"{per_update} rows (field 'global_batch_size'); verl's loop differs from "
                                     f"what trustscope reads")
        return base, base + index, updates * per_update

    def _check_same_response(self, step: int, update: int, sample_id: Tensor, tokens: Tensor, lengths: Tensor) -> None:
        """Each response trained again in a later update of the call must have the same tokens and mask; a
        :class:`VerlUpdateMismatch` names the step, the update and the field otherwise."""
        for sid, n, total in zip(sample_id.tolist(), lengths.tolist(), tokens.tolist(), strict=True):
            seen = self._shapes.get(sid)
            if seen is None:
                self._shapes[sid] = (update, n, total)
            elif seen[1] != n:
                raise VerlUpdateMismatch(f"step {step}, update {update}: sample_id {sid} has {n} response token(s), "
                                         f"{seen[1]} in update {seen[0]} (field 'response_mask')")
            elif seen[2] != total:
                raise VerlUpdateMismatch(f"step {step}, update {update}: sample_id {sid} has other token ids than in "
                                         f"update {seen[0]} (field 'responses')")

    def _log(self, step: int, model_output: Mapping[str, Any], data: Any, cols: Any, call: ActorCall,
             rank: int) -> None:
        no_padding_2_padding = need("verl.workers.utils.padding", "no_padding_2_padding")
        _, update, expected = self._update_of(data, step)
        sample_id = cols[SAMPLE_KEY]  # (B,)
        trained = cols["response_mask"].bool()  # (B, T) the mask verl's loss applies
        rejected = cols[REJECTED_KEY].bool() if REJECTED_KEY in cols else None  # (B, T)
        mask = trained if rejected is None else trained | rejected  # (B, T) every token of the response
        responses = cols["responses"]
        self._check_same_response(step, update, sample_id.cpu(), torch.where(mask, responses, 0).sum(-1).cpu(),
                                  mask.sum(-1).cpu())
        pi = no_padding_2_padding(model_output["log_probs"], data).detach()  # (B, T)
        old = cols["old_log_probs"]  # (B, T)
        tokens = {
            "token_id": responses,
            "mu_logprob": cols.get("rollout_log_probs", old),
            "pi_logprob": pi,
            "advantage": cols["advantages"],
            "kept": self._kept(call.keep, pi, old, cols["advantages"], trained),
            "sample_id": sample_id,
            "prompt_id": cols[PROMPT_KEY],
            "turn": torch.from_numpy(turns_from_mask(mask.cpu().numpy())).to(sample_id.device),
            "update_index": torch.full_like(sample_id, update, dtype=torch.int32),
        }
        if rejected is not None:
            tokens["rollout_rejected"] = rejected
        weights = cols.get("rollout_is_weights", None)
        if weights is not None and (call.is_applied or self.own_is_weights):
            tokens["is_weight"] = weights.float()
        if VERSION_KEY in cols:
            tokens["policy_version"] = cols[VERSION_KEY]
        if VERSION_LAST_KEY in cols:
            tokens["policy_version_last"] = cols[VERSION_LAST_KEY]
        routed = data.get("routed_experts", None) if self.logger_options.get("routing_shape") else None
        if routed is not None and routed.is_nested:  # R3: the engine's experts of every position fed
            tokens["engine_experts"] = no_padding_2_padding(routed, data).to(torch.int16)  # (B, T, L, k)
        if self.log_old_logprob:
            tokens["old_logprob"] = old
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            tokens["entropy"] = no_padding_2_padding(entropy, data).detach()
        if self._logger is None:
            self._open(rank)
        self._logger.log_step(step, tokens=tokens, mask=mask)
        self._rows += len(sample_id)
        if self._rows >= expected:
            self._logger.commit_step()  # this rank's share of the call is in; its writer thread commits it
            self._share_done = True

    def _open(self, rank: int) -> None:
        """This process's logger of the run (``rank``: trustscope's rank, the data-parallel rank + 1), opened at its
        first logged micro-batch and kept for the whole run (one per process: a hook unpickled again finds it);
        closed by :meth:`close`, by the :class:`FinishActors` that the driver's close sends, or at exit."""
        key = (self.logdir, self.run_id)
        logger = ACTOR_LOGGERS.get(key)
        if logger is None or logger._closed:
            logger = TokenLogger(self.logdir, self.run_id, rank=rank, resume=True,
                                 loss_rule=self.loss_rule, **self.logger_options)
            ACTOR_LOGGERS[key] = logger
            atexit.register(_close_actor_logger, key, self)
        self._logger = logger

    def _kept(self, keep: Tensor | None, pi: Tensor, old: Tensor, adv: Tensor, trained: Tensor) -> Tensor:
        if keep is not None:
            return keep & trained
        if self.mask_fn is not None:
            return self.mask_fn(pi, old, adv) & trained
        return trained

    def close(self) -> None:
        """Close this process's logger of the run (``finished``), if it opened one. Safe to call twice."""
        logger = ACTOR_LOGGERS.pop((self.logdir, self.run_id), None)
        if logger is not None:
            logger.close()
        self._logger = None


ACTOR_LOGGERS: dict[tuple[str, str], TokenLogger] = {}
"""This process's actor loggers, by (logdir, run id): one per rank for the whole run."""


def _close_actor_logger(key: tuple[str, str], hook: ActorLogHook) -> None:
    """At exit: a rank whose last call was all logged (and so committed) ends ``finished``; one that stopped
    inside a call is left to the logger's own exit hook, which records it ``crashed``."""
    logger = ACTOR_LOGGERS.get(key)
    if logger is not None and hook._share_done and not logger._closed:
        with contextlib.suppress(Exception):  # nothing left to report to at exit
            ACTOR_LOGGERS.pop(key, None)
            logger.close()


class FinishActors:
    """verl's loss again (``inner``), sent by the driver's close through ``set_loss_fn``: where it is built or
    unpickled (the driver, each actor process) it closes that process's logger of the run."""

    def __init__(self, inner: Callable[..., Any], logdir: str, run_id: str):
        self.inner, self.logdir, self.run_id = inner, logdir, run_id
        self._finish()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finish()

    def _finish(self) -> None:
        logger = ACTOR_LOGGERS.pop((self.logdir, self.run_id), None)
        if logger is not None:
            logger.close()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)
