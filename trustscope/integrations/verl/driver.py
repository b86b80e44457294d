"""The driver's side: the stamps every row of a step carries to the actors, and one ``samples`` row per response.

Before verl splits a batch, the driver stamps ``(B,)`` tensor columns into it (:data:`SAMPLE_KEY`: unique within
the step across all of its ``_update_actor`` calls; :data:`PROMPT_KEY`; the trajectory's first and last weight
versions on the V1 trainer) and the step, the call's row count and the index of the call's first update into its
meta information. Tensor columns travel with their rows through dispatch, shuffling, mini- and micro-batching and
dynamic batch sizes, so each actor row finds its ``samples`` row by ``(step, sample_id)`` and numbers its update.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trustscope.logger import TokenLogger

STEP_KEY = "trustscope_step"
BATCH_SIZE_KEY = "trustscope_batch_size"
UPDATE_BASE_KEY = "trustscope_update_base"
"""The index of the call's first update within the step (the updates of the step's earlier calls come before)."""
UPDATES_KEY = "trustscope_updates"
"""How many updates the call makes (mini-batches x epochs, :func:`updates_of_call`)."""
SAMPLE_KEY = "trustscope_sample_id"
PROMPT_KEY = "trustscope_prompt_id"
VERSION_KEY = "trustscope_policy_version"
VERSION_LAST_KEY = "trustscope_policy_version_last"
REJECTED_KEY = "trustscope_rollout_rejected"
"""``(B, T)`` bool: the tokens verl's rollout rejection sampling took out of ``response_mask`` (see
:mod:`trustscope.integrations.verl.rollout`)."""
META_KEYS = (STEP_KEY, BATCH_SIZE_KEY, UPDATE_BASE_KEY, UPDATES_KEY)
ROW_KEYS = (SAMPLE_KEY, PROMPT_KEY, VERSION_KEY, VERSION_LAST_KEY)
KEPT_SCALARS = ("actor/", "training/off_policy/", "rollout_corr/")
"""The step metrics kept as ``steps`` scalars at the actor update: verl's actor metrics, its own off-policy
(staleness, evicted samples) figures and its rollout-correction figures."""


def _prompt_ids(uids: Any, n: int) -> Tensor:
    """``(B,)`` int64 prompt ids: a stable 63-bit hash of verl's per-prompt ``uid`` (the row index without one)."""
    if uids is None:
        return torch.arange(n, dtype=torch.int64)
    ids = [int.from_bytes(hashlib.blake2b(str(u).encode(), digest_size=8).digest(), "little") >> 1 for u in uids]
    return torch.tensor(ids, dtype=torch.int64)


def _id_rows(ids: Tensor, mask: Tensor) -> list[Any]:
    """``(B, L)`` ids -> B arrays of the ids where ``mask`` is set (one transfer to the CPU)."""
    ids_np, mask_np = ids.cpu().numpy(), mask.bool().cpu().numpy()
    return [row[m] for row, m in zip(ids_np, mask_np, strict=True)]


def tag_versions(tags: Any, n: int) -> tuple[Tensor, Tensor] | None:
    """``(B,)`` int64 first and last weight versions of each response from verl V1's trajectory tags:
    ``min_global_steps`` and ``max_global_steps`` (the weights its generation started and ended under) + 1, in
    trustscope's (and verl's) step numbering; None when the tags lack them. verl keeps no version per token."""
    if not tags or len(tags) != n:
        return None
    out = []
    for name in ("min_global_steps", "max_global_steps"):
        values = [tag.get(name) if isinstance(tag, Mapping) else None for tag in tags]
        if any(not isinstance(v, numbers.Integral) for v in values):
            return None
        out.append(torch.tensor([int(v) + 1 for v in values], dtype=torch.int64))
    first, last = out
    return first, torch.maximum(first, last)


def updates_of_call(n: int, mini_batch: int, epochs: int) -> int:
    """How many optimizer updates verl's ``train_mini_batch`` makes of a call of ``n`` rows: ``n // mini_batch``
    mini-batches (at least one) in each of ``epochs`` epochs."""
    return max(n // max(mini_batch, 1), 1) * max(epochs, 1)


def log_driver_batch(logger: TokenLogger, batch: Any, step: int, tokenizer: Any = None, *, first_id: int = 0,
                     update_base: int = 0, updates: int = 1) -> int:
    """Stamp the sample and prompt ids and the step into verl ``DataProto`` ``batch``; log one ``samples`` row each;
    returns the number of rows.

    ``batch`` is the driver's batch as it goes into the actor update: ``responses`` and ``response_mask``
    ``(B, T)``, optionally ``advantages`` and ``token_level_scores`` ``(B, T)``, ``prompts`` and
    ``attention_mask``, :data:`REJECTED_KEY` (rollout rejection sampling) and ``uid`` in ``non_tensor_batch``. The
    sample ids are ``first_id + arange(B)``: a step of several ``_update_actor`` calls numbers its rows on (the
    driver is the only source of sample ids, so they are unique across the actor ranks too); ``update_base`` and
    ``updates`` number the call's updates within the step (:func:`updates_of_call`). A response's length
    counts its rejected tokens: they are part of the response, logged like the others. Adds
    ``trustscope_sample_id`` / ``trustscope_prompt_id`` ``(B,)`` to ``batch.batch`` and :data:`META_KEYS` to
    ``batch.meta_info``; :func:`unstamp_batch` removes them.
    """
    tensors = batch.batch
    for key in ("responses", "response_mask"):
        if key not in tensors:
            raise KeyError(f"verl batch has no {key!r} (keys: {sorted(tensors.keys())}); is it the actor-update batch?")
    mask = tensors["response_mask"].bool()  # (B, T)
    if REJECTED_KEY in tensors:
        mask = mask | tensors[REJECTED_KEY].bool()  # (B, T) the response before rejection sampling
    n = mask.shape[0]
    sample_id = torch.arange(first_id, first_id + n, dtype=torch.int64)  # (B,)
    prompt_id = _prompt_ids(batch.non_tensor_batch.get("uid"), n)  # (B,)
    tensors[SAMPLE_KEY] = sample_id
    tensors[PROMPT_KEY] = prompt_id
    batch.meta_info.update({STEP_KEY: int(step), BATCH_SIZE_KEY: n, UPDATE_BASE_KEY: int(update_base),
                            UPDATES_KEY: int(updates)})
    samples: dict[str, Any] = {"sample_id": sample_id, "prompt_id": prompt_id, "length": mask.sum(-1)}
    lengths = mask.sum(-1).clamp_min(1)
    if "advantages" in tensors:
        adv = tensors["advantages"].float()
        samples["advantage"] = torch.where(mask, adv, torch.zeros_like(adv)).sum(-1) / lengths  # (B,)
    for key in ("token_level_scores", "token_level_rewards"):
        if key in tensors:
            samples["reward"] = torch.where(mask, tensors[key].float(), torch.zeros_like(tensors[key].float())).sum(-1)
            break
    if tokenizer is not None:  # token ids: the logger's writer thread decodes its text_fraction sample
        samples["response_token_ids"] = _id_rows(tensors["responses"], mask)
        if "prompts" in tensors and "attention_mask" in tensors:
            prompts = tensors["prompts"]
            samples["prompt_token_ids"] = _id_rows(prompts, tensors["attention_mask"][:, : prompts.shape[1]])
    logger.log_step(int(step), samples=samples)
    return n


def unstamp_batch(batch: Any) -> None:
    """Remove what :func:`log_driver_batch` (and the rollout-correction wrapper) added to ``batch``."""
    for key in (*ROW_KEYS, REJECTED_KEY):
        if key in batch.batch:
            del batch.batch[key]
    for key in META_KEYS:
        batch.meta_info.pop(key, None)


def actor_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's actor metrics (a number or a list per micro-batch each) as one float per name (lists: their mean)."""
    out = {}
    for name, value in metrics.items():
        values = value if isinstance(value, list | tuple) else [value]
        floats = [float(v) for v in values if isinstance(v, numbers.Real) or (isinstance(v, Tensor) and v.numel() == 1)]
        if floats and len(floats) == len(values):
            out[name] = sum(floats) / len(floats)
    return out


class DriverBatch:
    """The driver batch as :func:`log_driver_batch` reads it (``batch``, ``non_tensor_batch``, ``meta_info``),
    built from what verl's V1 trainer keeps in TransferQueue; the stamps it adds land here too."""

    def __init__(self, tensors: dict[str, Tensor], uids: list[str]):
        self.batch, self.non_tensor_batch, self.meta_info = tensors, {"uid": uids}, {}


V1_DRIVER_FIELDS = ("response_mask", "advantages", "token_level_scores", "token_level_rewards", REJECTED_KEY)
"""What the driver reads of each row from TransferQueue for its ``samples`` row (length, advantage, reward); with
a tokenizer (text) also ``responses`` and ``prompts``. Every per-token figure stays with the actors."""


def padded(t: Tensor) -> tuple[Tensor, Tensor]:
    """A TransferQueue column ``(B, ...)``: nested (one length per sample) or dense -> ``(B, L)`` right-padded
    with 0, and ``(B, L)`` bool of the real entries."""
    if not t.is_nested:
        return t, torch.ones(t.shape[:2], dtype=torch.bool, device=t.device)
    lengths = torch.tensor([len(row) for row in t.unbind()], device=t.device)  # (B,)
    dense = torch.nested.to_padded_tensor(t, 0.0)
    return dense, torch.arange(dense.shape[1], device=t.device) < lengths[:, None]


def read_v1_batch(batch: Any, text: bool = False) -> DriverBatch:
    """What verl's V1 trainer keeps of ``batch`` (a TransferQueue ``KVBatchMeta``) for the ``samples`` rows:
    the response mask, advantages and rewards (:data:`V1_DRIVER_FIELDS`), padded, and with ``text`` the responses
    and prompts; the prompt group from the sample key (verl names a trajectory ``{uid}_{session}_{index}``)."""
    import transfer_queue as tq

    have = set(batch.fields or [])
    missing = [f for f in ("responses", "response_mask") if f not in have]
    if missing:
        raise KeyError(f"verl V1 batch (TransferQueue partition {batch.partition_id!r}) has no {missing}; fields: "
                       f"{sorted(have)}; is it the actor-update batch?")
    wanted = (*V1_DRIVER_FIELDS, "responses", "prompts") if text else V1_DRIVER_FIELDS
    fields = [f for f in wanted if f in have]
    data = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id, select_fields=fields)
    tensors = {f: padded(data[f])[0] for f in fields}
    if "responses" not in tensors:  # only the mask's shape is read without text
        tensors["responses"] = tensors["response_mask"]
    if "prompts" in tensors:  # right-padded here; log_driver_batch reads the prompt's mask from attention_mask
        tensors["attention_mask"] = padded(data["prompts"])[1].long()
    return DriverBatch(tensors, [str(k).split("_", 1)[0] for k in batch.keys])
