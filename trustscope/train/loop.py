"""The integrated trainer: GRPO-style RL with any registered trust-region rule, logging itself as it goes.

Run it::

    trustscope train                                  # DPPO binary TV on the toy world (tiny Qwen2, addition)
    trustscope train --loss cispo --engine-dtype bfloat16 --steps 100
    trustscope train --config run.toml --lr 1e-6      # a file, then overrides of any TrainConfig field
    trustscope train --run-id my-run --resume         # continue a run from its newest checkpoint, same log
    trustscope train --model Qwen/Qwen3-1.7B-Base --task add2 --max-tokens 64 --lr 1e-6   # a real model, GPU
    trustscope train --list-options                   # every field, its default and its meaning
    torchrun --nproc-per-node 2 -m trustscope.cli train --engine hf   # data-parallel: DDP, gloo on CPU, NCCL on GPU

On a GPU the trainer and vLLM find the device themselves; vLLM's context defaults to 128 tokens, so a real model
needs ``--engine-options '{"max_model_len": 1024}'`` or so. From Python: ``train(TrainConfig(loss="dppo_topk_tv"))``.
The run lives in ``<logdir>/<run_id>/``: the log (``run.json``, ``tokens/``, ``samples/``, ``steps/``, read by
``trustscope dashboard``) and ``checkpoints/``.

One step, top to bottom: rollouts from the engine (mu's logprob and top-K at every sampled token) -> rewards ->
group advantages -> optional pi_old recompute -> mini-batch updates with the rule ``get_loss(cfg.loss)`` and
``aggregate(..., cfg.aggregation)``, gradient clipping, a learning-rate schedule -> weight sync into the engine ->
tokens, samples and scalars into the TokenLogger -> periodic evaluation on held-out problems -> checkpoints.

Data-parallel (torchrun): rank 0 samples each step's whole batch as one process would and scatters equal blocks
of whole groups; every rank trains its share under DistributedDataParallel and logs its own files into the run;
rank 0 alone syncs the engine, evaluates, logs the scalars and checkpoints. A 2-rank run equals the 1-rank run at
the same ``prompts_per_step`` to float tolerance (see :func:`update_policy` and ``docs/scale.md``).

Mismatch knobs: ``engine_dtype`` (bf16 rollouts against an fp32 trainer), ``policy_lag`` (step s trains on
rollouts sampled with the weights of step s - lag, as in asynchronous RL), ``sync_every`` (the engine's weights
are refreshed only every k steps), ``recompute_old``, and asynchronous partial rollouts (``async_chunk_tokens``,
``async_batches``, ``max_staleness``: responses continued across weight updates, :class:`PartialRollouts`). Every
token is logged with the ``policy_version`` that sampled it.

Where it departs from the paper's recipe (verl, DAPO data, 16 responses per prompt, lr 1e-6):
- Scale: a tiny model and one-digit addition by default, so the defaults (lr 2e-4, 8 responses per prompt, 8
  new tokens) are the toy world's, not the paper's.
- Evaluation decodes greedily with the trainer's own weights (transformers ``generate``), not with the engine,
  so it measures the policy being trained even when the engine lags behind.
- pi_old, when recomputed, uses the trainer's weights at the start of the step; with ``policy_lag > 0`` these
  are newer than the rollout's (the decoupled-PPO "proximal" policy), as in asynchronous trainers.
- With ``epochs > 1`` the log keeps pi, the mask and the entropy of each token's last update.
- No KL penalty to a reference model and no entropy bonus (the paper uses neither).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.loop")

from trustscope.capture import Capture, capture
from trustscope.divergence import binary_tv
from trustscope.engines import DTYPES, make_engine
from trustscope.logger import NullLogger, TokenLogger
from trustscope.losses import PolicyBatch, aggregate, get_loss
from trustscope.trackers import RunReporting, parse_report_to
from trustscope.train import moe
from trustscope.train.attribution import Attribution
from trustscope.train.checkpoints import Start, restore, save_checkpoint, snapshot, with_weights
from trustscope.train.config import TrainConfig, check_world, staleness_bound
from trustscope.train.models import portable, resolve_device, resolve_model
from trustscope.train.multiturn import evaluate_tool, turn_summary
from trustscope.train.ranks import Ranks, aggregate_weight, join_ranks, local_rows, reduce_metrics
from trustscope.train.rollouts import PartialRollouts, StepRollouts, rollout_stream, step_seed
from trustscope.train.sampling import keep_support
from trustscope.train.tasks import Task, get_task


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, optionally over the group's std. ``(B,)`` -> ``(B,)``."""
    r = rewards.view(-1, group_size)  # (B / G, G)
    adv = r - r.mean(-1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(-1, keepdim=True) + 1e-6)
    return adv.reshape(-1)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` at a step: linear warm-up, then constant, linear or cosine decay to 0."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return f


def policy_forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor], response_ids: torch.Tensor,
                   topk_ids: torch.Tensor | None, rows: torch.Tensor, temperature: float,
                   truncation: tuple[float, int] | None = None) -> Capture:
    """pi at the sampled tokens (differentiable), at mu's top-K ids, and its entropy, for batch rows ``rows``.

    ``inputs`` hold prompt (left-padded) + response (right-padded) of width P + T; only the last T + 1 logit
    columns are computed, the first of which predicts response token 0. Logits are divided by the sampling
    temperature, because mu is the tempered distribution the engine drew from. ``truncation`` (``(top_p,
    top_k)``, the keep-sampling mask): pi renormalised over the sampler's support (:mod:`trustscope.train.sampling`).
    """
    t = response_ids.shape[1]
    logits = model(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                   position_ids=inputs["position_ids"][rows], logits_to_keep=t + 1).logits  # (b, T + 1, V)
    if temperature != 1.0:
        logits = logits / temperature
    topk = None if topk_ids is None else topk_ids[rows]
    if truncation is not None:
        return capture(keep_support(logits[:, :t], response_ids[rows], *truncation), response_ids[rows],
                       mu_topk_ids=topk)
    return capture(logits, response_ids[rows], response_start=1, mu_topk_ids=topk)


def truncation(cfg: TrainConfig) -> tuple[float, int] | None:
    """``(top_p, top_k)`` when the trainer applies the sampler's support to its logits (``keep_sampling_mask``)."""
    return (cfg.top_p, cfg.top_k) if cfg.keep_sampling_mask else None


# ---------------------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, task: Task, cfg: TrainConfig, device: torch.device) -> dict[str, float]:
    """Greedy accuracy of the trainer's current weights on the first ``eval_problems`` held-out problems."""
    problems = task.split("eval")[: cfg.eval_problems]
    was_training = model.training
    model.eval()
    rewards: list[float] = []
    if task.tool is not None:  # multi-turn: greedy turns with the tool's replies spliced in
        rewards = evaluate_tool(model, tokenizer, task, problems, cfg.max_tokens, device)
        problems = []  # scored: the single-turn loop below has nothing left to do
    for i in range(0, len(problems), 64):
        chunk = problems[i : i + 64]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, padding_side="left").to(device)
        out = model.generate(**enc, do_sample=False, max_new_tokens=cfg.max_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        gen = out[:, enc["input_ids"].shape[1] :]  # (b, T)
        texts, finish = [], []
        for row in gen.tolist():
            stop = tokenizer.eos_token_id in row
            ids = row[: row.index(tokenizer.eos_token_id)] if stop else row
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            finish.append("stop" if stop else "length")
        rewards += task.score(chunk, texts, finish)
    model.train(was_training)
    return {"eval/reward": float(np.mean(rewards)) if rewards else float("nan"), "eval/problems": len(rewards)}



# ---------------------------------------------------------------------------------------------------------------
# the run


def build_policy(cfg: TrainConfig, start: Start, device: torch.device) -> tuple[Any, torch.nn.Module, Any, Any]:
    """The tokenizer, the trainable model, AdamW and its learning-rate schedule, at ``start``'s state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(start.weights_dir)
    model = AutoModelForCausalLM.from_pretrained(start.weights_dir, dtype=DTYPES[cfg.trainer_dtype]).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if start.trainer_state is not None:
        optimizer.load_state_dict(start.trainer_state["optimizer"])
        scheduler.load_state_dict(start.trainer_state["scheduler"])
    return tokenizer, model, optimizer, scheduler


@dataclass
class StepInputs:
    """One step's rollouts as trainer tensors on the device, with advantages and (optionally) pi_old."""

    mask: torch.Tensor  # (B, T)
    adv_seq: torch.Tensor  # (B,) group advantages
    adv: torch.Tensor  # (B, T) the sample's advantage at each of its tokens
    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask, position_ids: (B, P + T) each
    response_ids: torch.Tensor  # (B, T)
    mu_lp: torch.Tensor  # (B, T)
    mu_topk_lp: torch.Tensor  # (B, T, K)
    topk_ids: torch.Tensor  # (B, T, K)
    old_lp: torch.Tensor | None  # (B, T) pi_old, when recomputed
    routing: moe.StepRouting | None = None  # MoE: both sides' experts, the replay (train/moe.py)
    turn: torch.Tensor | None = None  # (B, T) int32, multi-turn rollouts: each token's model turn
    engine_ids: torch.Tensor | None = None  # (B, T) long, multi-turn rollouts: the id the engine returned


def step_inputs(batch: StepRollouts, cfg: TrainConfig, model: torch.nn.Module, pad_id: int,
                device: torch.device, replay: Any = None) -> StepInputs:
    """Pad the batch into tensors, compute group advantages, recompute pi_old when ``cfg.recompute_old``."""
    ro = batch.rollout.to_tensors(pad_id)
    mask = ro.mask.to(device)  # (B, T)
    adv_seq = group_advantages(batch.rewards, cfg.group_size, cfg.std_normalize).to(device)  # (B,)
    inputs = dict(input_ids=ro.input_ids.to(device), attention_mask=ro.attention_mask.to(device),
                  position_ids=ro.position_ids.to(device))  # (B, P + T) each
    x = StepInputs(mask=mask, adv_seq=adv_seq, adv=adv_seq[:, None].expand_as(mask).float(), inputs=inputs,
                   response_ids=ro.response_ids.to(device), mu_lp=ro.mu_logprob.to(device),
                   mu_topk_lp=ro.mu_topk_logprobs.to(device), topk_ids=ro.mu_topk_ids.to(device), old_lp=None,
                   routing=moe.step_routing(batch.rollout, ro.prompt_len, ro.input_ids.shape[1], replay, cfg),
                   turn=ro.turn, engine_ids=ro.engine_ids)
    if cfg.recompute_old:
        rows = torch.arange(mask.shape[0], device=device)
        with torch.no_grad(), moe.routed(x.routing, rows):
            x.old_lp = policy_forward(model, inputs, x.response_ids, None, rows, cfg.temperature,
                                      truncation(cfg)).logprob
    return x


@dataclass
class Update:
    """What the step's updates did; pi, its top-K, the entropy and the keep-mask are each token's last update's."""

    pi_lp: torch.Tensor  # (B, T)
    pi_topk_lp: torch.Tensor  # (B, T, K)
    entropy: torch.Tensor  # (B, T)
    kept: torch.Tensor  # (B, T)
    losses: list[float]  # one per optimizer update
    grad_norms: list[float]  # one per update when clipping is on
    metrics: dict[str, float]  # the rule's metrics, averaged over the updates


def update_policy(model: torch.nn.Module, optimizer: Any, rule: Any, cfg: TrainConfig, step: int,
                  x: StepInputs, ranks: Ranks) -> Update:
    """``epochs`` passes over the step's responses in ``mini_batches`` shuffled mini-batches, one AdamW update
    each: pi at the sampled tokens and at mu's top-K, the rule's loss, ``aggregate``, gradient clipping.

    Data-parallel (``model`` wrapped in DistributedDataParallel): the shuffle is over the whole step's samples,
    the same on every rank, and each rank trains the part of every mini-batch it holds, weighted by its share of
    the mini-batch's ``aggregate`` normaliser (:func:`aggregate_weight`), times ``world`` because DDP averages the
    gradients: the summed gradient, the loss and the update are the one-rank run's. A rank holding none of a
    mini-batch runs one row at weight 0, since every rank must take part in the gradient all-reduce. The rule's
    metrics are averaged over the ranks weighted by their valid tokens (``*_max`` ones: the maximum).
    """
    b = x.mask.shape[0]  # this rank's rows; the step has b * world
    up = Update(pi_lp=torch.zeros_like(x.mu_lp), pi_topk_lp=torch.zeros_like(x.mu_topk_lp),
                entropy=torch.zeros_like(x.mu_lp), kept=torch.zeros_like(x.mask), losses=[], grad_norms=[],
                metrics={})
    plan = []  # (epoch, mini-batch) -> this rank's rows
    for epoch in range(cfg.epochs):
        order = torch.randperm(b * ranks.world,
                               generator=torch.Generator().manual_seed(step_seed(cfg.seed, step, 3 + epoch)))
        plan += [local_rows(idx, ranks.rank, b).to(x.mask.device) for idx in order.chunk(cfg.mini_batches)]
    weights = torch.tensor([aggregate_weight(cfg.aggregation, x.mask[idx], cfg.max_tokens) for idx in plan],
                           dtype=torch.float64)  # (epochs * mini_batches,)
    totals = ranks.sum(weights)
    for idx, weight, total in zip(plan, weights.tolist(), totals.tolist(), strict=True):
        rows = idx if len(idx) else torch.zeros(1, dtype=torch.long, device=x.mask.device)
        with moe.routed(x.routing, rows, len(idx)):
            cap = policy_forward(model, x.inputs, x.response_ids, x.topk_ids, rows, cfg.temperature, truncation(cfg))
        pb = PolicyBatch(pi_logprob=cap.logprob, mu_logprob=x.mu_lp[rows], advantages=x.adv[rows],
                         mask=x.mask[rows], old_logprob=None if x.old_lp is None else x.old_lp[rows],
                         mu_topk_logprobs=x.mu_topk_lp[rows], pi_topk_logprobs=cap.topk_logprobs)
        out = rule(pb, **cfg.loss_params)
        loss = aggregate(out.loss, x.mask[rows], cfg.aggregation, max_len=cfg.max_tokens)
        if ranks.world > 1:  # this rank's part of the mini-batch's loss; 1.0 exactly on one rank
            loss = loss * (weight / max(total, 1.0))
        optimizer.zero_grad(set_to_none=True)
        (loss * ranks.world if ranks.world > 1 else loss).backward()
        if cfg.grad_clip > 0:
            up.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        optimizer.step()
        up.losses.append(float(ranks.sum(loss.detach())))
        for name, value in reduce_metrics(out.metrics, float(x.mask[idx].sum()), ranks).items():
            up.metrics[name] = up.metrics.get(name, 0.0) + value
        up.pi_lp[idx] = cap.logprob.detach()[: len(idx)]
        up.pi_topk_lp[idx] = cap.topk_logprobs.detach()[: len(idx)]
        up.entropy[idx] = cap.entropy.detach()[: len(idx)]
        up.kept[idx] = out.keep[: len(idx)]
    up.metrics = {name: total / len(up.losses) for name, total in up.metrics.items()}
    return up



def step_totals(x: StepInputs, up: Update, ranks: Ranks) -> dict[str, float]:
    """The step's token sums over all ranks: tokens, entropy and (when recomputed) the pi_old-mu mismatch."""
    sums = [x.mask.sum().double(), (up.entropy * x.mask).sum().double()]
    if x.old_lp is not None:
        sums.append((binary_tv(x.mu_lp, x.old_lp) * x.mask).sum().double())
    total = ranks.sum(torch.stack(sums)).tolist()
    return {"tokens": total[0], "entropy": total[1], **({} if x.old_lp is None else {"old_mismatch": total[2]})}


def step_scalars(batch: StepRollouts, totals: dict[str, float], up: Update, step: int, lr: float,
                 times: dict[str, float]) -> dict[str, float]:
    """The step's scalars for the log and the progress bar, from the whole step's ``batch`` and the ranks'
    ``totals`` (:func:`step_totals`); ``times``: rollout, train, sync, step seconds (rank 0's)."""
    b, n_tokens = len(batch.rollout), int(totals["tokens"])
    scalars = {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()),
        "loss": float(np.mean(up.losses)),
        "lr": lr,
        "grad_norm": float(np.mean(up.grad_norms)) if up.grad_norms else float("nan"),
        "updates": len(up.losses),
        "policy_lag": step - batch.weights_step,
        "response/length_mean": n_tokens / b,
        "response/stop_frac": float(np.mean([f == "stop" for f in batch.rollout.finish_reasons])),
        "entropy/mean": totals["entropy"] / max(1, n_tokens),
        "tokens": n_tokens,
        **{f"time/{name}_s": seconds for name, seconds in times.items()},
        "throughput/tokens_per_s": n_tokens / times["step"],
        **up.metrics,
        **batch.stats,
        **turn_summary(batch.rollout),
    }
    if "old_mismatch" in totals:
        scalars["mismatch/old_abs_mean"] = totals["old_mismatch"] / max(1, n_tokens)
    return scalars


def log_step(logger: Any, step: int, batch: StepRollouts, x: StepInputs, up: Update,
             scalars: dict[str, float] | None) -> None:
    """This rank's tokens and responses of the step, and the step's scalars (rank 0 only), into its TokenLogger.
    Sample ids and prompt ids are step-wide (``first_group`` on), so the ranks' rows form one run's step."""
    b = x.mask.shape[0]
    first_sample = batch.first_group * batch.rollout.n
    logger.log_step(
        step,
        tokens={"token_id": x.response_ids, "mu_logprob": x.mu_lp, "pi_logprob": up.pi_lp, "advantage": x.adv,
                "entropy": up.entropy, "mu_topk_ids": x.topk_ids, "mu_topk_logprobs": x.mu_topk_lp,
                "pi_topk_logprobs": up.pi_topk_lp, "kept": up.kept, "policy_version": token_versions(batch, x.mask),
                **({} if x.old_lp is None else {"old_logprob": x.old_lp}), **turn_tokens(x),
                **({} if x.routing is None else x.routing.tokens())},
        mask=x.mask,
        samples={"sample_id": first_sample + np.arange(b),
                 "prompt_id": batch.first_group + np.asarray(batch.rollout.prompt_index),
                 "prompt": [batch.problems[i].prompt for i in batch.rollout.prompt_index],
                 "response": batch.rollout.texts, "reward": batch.rewards, "advantage": x.adv_seq,
                 "finish_reason": batch.rollout.finish_reasons},
        scalars=scalars,
    )


def token_versions(batch: StepRollouts, mask: torch.Tensor) -> np.ndarray:
    """``(B, T)`` int64: the weight version that sampled each token (``batch.versions``, else the batch's one
    ``weights_step``), ``weights_step`` on padding."""
    out = np.full(tuple(mask.shape), batch.weights_step, dtype=np.int64)
    for i, versions in enumerate(batch.versions or []):
        out[i, : len(versions)] = versions
    return out


def turn_tokens(x: StepInputs) -> dict[str, torch.Tensor]:
    """A multi-turn step's per-token ``turn`` and ``engine_token_id`` columns (nothing for one model turn)."""
    if x.turn is None:
        return {}
    return {"turn": x.turn, "engine_token_id": x.engine_ids}


def train(cfg: TrainConfig, on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Train as ``cfg`` says; call ``on_step(step, scalars)`` after every step; return the last step's scalars.

    Under ``torchrun`` (or in an initialised ``torch.distributed`` group) it trains data-parallel: rank 0 samples
    each step's whole batch exactly as a one-rank run would and scatters whole groups to the ranks, every rank
    trains its share under DistributedDataParallel and logs its own files into the same run, and rank 0 alone
    syncs the engine, evaluates, logs the step scalars, writes checkpoints and calls ``on_step``; the other ranks
    return ``{}``.
    """
    # ---- setup -------------------------------------------------------------------------------------------------
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    ranks, device, joined = join_ranks(resolve_device(cfg.device))
    check_world(cfg, ranks.world)
    cfg = cfg.replace(run_id=ranks.from_main(cfg.run_id))  # a default run id holds the time, which ranks differ on
    rule = get_loss(cfg.loss)
    task = get_task(cfg.task)
    model_dir = resolve_model(cfg) if ranks.main else None  # rank 0 builds (or finds) the toy world first
    ranks.barrier()
    model_dir = model_dir or resolve_model(cfg)
    start = restore(cfg, model_dir, main=ranks.main)
    ranks.barrier()  # every rank has checked for an existing run before any rank's logger creates it
    tokenizer, model, optimizer, scheduler = build_policy(cfg, start, device)
    routing = moe.routing_shape(cfg, model)  # MoE: both sides' experts logged, replayed on request
    replay = moe.replay_hooks(model, routing)
    trained = model if ranks.world == 1 else torch.nn.parallel.DistributedDataParallel(model)
    keep_engine_copy = cfg.sync_every > 1 and cfg.save_every > 0  # an exact resume needs the engine's weights
    engine_copy = start.engine_state if start.engine_state is not None else (
        snapshot(model) if keep_engine_copy else None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scalars: dict[str, float] = {}
    attribution = Attribution(cfg, model, routing, start.step) if cfg.explain_tokens and ranks.main else None

    with contextlib.ExitStack() as running:  # closes the logger (finished or crashed), the engine, the group
        if joined:
            running.callback(dist.destroy_process_group)
        engine = stream = partial = None
        if ranks.main:  # the one engine: it samples every step's whole batch
            engine = running.enter_context(make_engine(cfg.engine, str(start.weights_dir), dtype=cfg.engine_dtype,
                                                       seed=cfg.seed, logprobs_mode=cfg.logprobs_mode,
                                                       **cfg.engine_options,
                                                       **moe.engine_kwargs(routing, cfg)))
            if start.engine_state is not None:  # the engine was lagging behind the trainer at the checkpoint
                engine.update_weights(with_weights(start.weights_dir, cfg, start.engine_state))
            partial = PartialRollouts(engine, task, cfg, start.async_state) if cfg.async_chunk_tokens else None
            stream = (partial.stream(start.step) if partial is not None
                      else rollout_stream(engine, task, cfg, start.step, start.pending))
        logger = running.enter_context(_make_logger(cfg, model_dir, engine, tokenizer, model, ranks, routing))
        reporting = None
        if ranks.main and (cfg.report_to or cfg.webhook):  # closed before the logger (the last step reported)
            from trustscope.early_warning import WarningLines

            reporting = running.enter_context(RunReporting(logger, parse_report_to(cfg.report_to), cfg.webhook,
                                                           cfg.run_dir, cfg.run_id, cfg.to_dict(),
                                                           lines=WarningLines(relative_z=cfg.warn_relative or None)))

        # ---- steps ---------------------------------------------------------------------------------------------
        for step in range(start.step, cfg.steps):
            t0 = time.perf_counter()
            batch = next(stream) if stream is not None else None  # the whole step, on rank 0
            mine = ranks.share(batch)
            t_rollout = time.perf_counter() - t0
            x = step_inputs(mine, cfg, model, pad_id, device, replay)
            measured = ({} if attribution is None else
                        attribution.measure(step, model, x, token_versions(mine, x.mask)))  # before the update

            t1 = time.perf_counter()
            up = update_policy(trained, optimizer, rule, cfg, step, x, ranks)
            scheduler.step()
            t_train = time.perf_counter() - t1

            t2 = time.perf_counter()
            synced = (step + 1) % cfg.sync_every == 0
            if synced and engine is not None:
                engine.update_weights(model)
                engine_copy = snapshot(model) if keep_engine_copy else None
                if attribution is not None:
                    attribution.synced(step + 1, model)
                if partial is not None:  # responses in flight continue under the new version
                    partial.state.version = step + 1
            t_sync = time.perf_counter() - t2
            times = {"rollout": t_rollout, "train": t_train, "sync": t_sync, "step": time.perf_counter() - t0}

            last = step + 1 == cfg.steps
            evals = {}
            if ranks.main and cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
                t3 = time.perf_counter()
                evals = {**evaluate(model, tokenizer, task, cfg, device), "time/eval_s": time.perf_counter() - t3}

            # ---- log, checkpoint ---------------------------------------------------------------------------
            totals = step_totals(x, up, ranks)
            if batch is not None:
                scalars = {**step_scalars(batch, totals, up, step, scheduler.get_last_lr()[0], times), **evals,
                           **moe.step_scalars(x.routing), **measured}
            log_step(logger, step, mine, x, up, scalars if ranks.main else None)
            if reporting is not None:
                reporting.step(step, scalars)
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or last):
                logger.flush()  # on every rank: each log file then ends at or before the checkpoint
                if ranks.main:
                    save_checkpoint(cfg, step, model, tokenizer, optimizer, scheduler, start.pending,
                                    None if synced else engine_copy, None if partial is None else partial.state)
            if on_step is not None and ranks.main:
                on_step(step, scalars)
    return scalars



def _make_logger(cfg: TrainConfig, model_dir: Path | str, engine: Any, tokenizer: Any, model: torch.nn.Module,
                 ranks: Ranks, routing: tuple[int, int, int] | None = None) -> Any:
    """This rank's TokenLogger (or the no-op logger), with the config, model and sampler in the manifest (rank 0
    has the engine; the other ranks' manifests keep only their status)."""
    if not cfg.log_tokens:
        return NullLogger()
    sampling = None if engine is None else {**engine.sampling_info(), "temperature": cfg.temperature,
                                             "top_p": cfg.top_p, "top_k": cfg.top_k, "topk_logprobs": cfg.topk,
                                             "keep_sampling_mask": cfg.keep_sampling_mask}
    if sampling and sampling.get("model_dir"):
        sampling["model_dir"] = portable(sampling["model_dir"])
    model_info = {"name": portable(cfg.model), "path": portable(model_dir),
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "dtype": cfg.trainer_dtype, "architecture": type(model).__name__}
    config = {**cfg.to_dict(), "model": portable(cfg.model), "logdir": portable(cfg.logdir)}
    os.makedirs(cfg.logdir, exist_ok=True)
    return TokenLogger(cfg.logdir, run_id=cfg.run_id, config=config, model=model_info, sampling=sampling,
                       tokenizer={"name": portable(getattr(tokenizer, "name_or_path", "")),
                                  "vocab_size": len(tokenizer)},
                       vocab=tokenizer, loss_rule=get_loss(cfg.loss).name, rank=ranks.rank, resume=cfg.resume,
                       token_fraction=cfg.log_token_fraction, log_topk=cfg.log_topk,
                       topk_precision=cfg.log_topk_precision, max_staleness=staleness_bound(cfg),
                       **({"routing_shape": routing, "routing_replay": cfg.routing_replay} if routing else {}))


# ---------------------------------------------------------------------------------------------------------------
# the command line's face


def train_with_progress(cfg: TrainConfig) -> dict[str, float]:
    """:func:`train` under a live rich progress bar (step, reward, mismatch |pi - mu|, blocked fraction, tokens/s)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun, rank 0 alone shows the run
        return train(cfg)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the engine's per-sync log lines off the bar
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console(stderr=True)
    console.print(f"[bold]trustscope train[/bold] run [cyan]{cfg.run_id}[/cyan] -> {cfg.run_dir}  "
                  f"(loss {cfg.loss}, engine {cfg.engine}/{cfg.engine_dtype}, {rollout_mode(cfg)})")
    columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
               TimeElapsedColumn())
    every = max(1, cfg.steps // 20)  # steps between two progress lines when stderr is not a terminal
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=cfg.steps, completed=0, stats="starting (engine, toy world) ...")

        def on_step(step: int, s: dict[str, float]) -> None:
            stats = (f"reward {s['reward/mean']:.3f}  |pi-mu| {s.get('policy/mismatch_abs_mean', float('nan')):.4f}  "
                     f"blocked {s.get('policy/blocked_frac', float('nan')):.2%}{blocked_count(s, cfg.epochs)}  "
                     f"{s['throughput/tokens_per_s']:.0f} tok/s")
            if "eval/reward" in s:
                stats += f"  eval {s['eval/reward']:.3f}"
            bar.update(task, completed=step + 1, stats=stats)
            if not console.is_terminal and ((step + 1) % every == 0 or step + 1 == cfg.steps):
                console.print(f"step {step + 1}/{cfg.steps}  {stats}")  # a log file gets a line, not a bar

        result = train(cfg, on_step=on_step)
    console.print(f"done: {cfg.run_dir}  (trustscope dashboard {cfg.logdir})")
    return result


def blocked_count(s: dict[str, float], epochs: int = 1) -> str:
    """`` (12 of 4,880 tokens)``: what the step's updates blocked of its tokens with A != 0, from the per-update means
    ``policy/n_blocked`` and ``policy/n_grad_tokens`` times ``updates`` (token updates when ``epochs`` > 1, where
    each token is updated once an epoch); empty when the rule reports no counts."""
    if "policy/n_blocked" not in s or "policy/n_grad_tokens" not in s:
        return ""
    n = s.get("updates", 1)
    unit = "tokens" if epochs == 1 else "token updates"
    return f" ({round(s['policy/n_blocked'] * n):,} of {round(s['policy/n_grad_tokens'] * n):,} {unit})"


def rollout_mode(cfg: TrainConfig) -> str:
    """How the run samples, for the progress line: ``lag k``, or the asynchronous partial rollouts' settings."""
    if not cfg.async_chunk_tokens:
        return f"lag {cfg.policy_lag}"
    bound = "unbounded" if cfg.max_staleness < 0 else f"max staleness {cfg.max_staleness}"
    return f"async: {cfg.async_chunk_tokens}-token chunks, {cfg.async_batches} batches in flight, {bound}"


def print_options() -> None:
    """Print every TrainConfig field as a command-line option with its default and its docstring."""
    from rich.console import Console
    from rich.table import Table

    from trustscope.train.config import field_docs

    table = Table("option", "default", "meaning", show_lines=False)
    defaults = TrainConfig(run_id="x").to_dict()
    for name, doc in field_docs().items():
        default = "" if name == "run_id" else defaults[name]
        table.add_row(f"--{name.replace('_', '-')}", repr(default), doc)
    Console().print(table)
