"""verl's actor inputs for ``bench_verl.py``: a driver batch, the engine's model output and an actor config.

The one place they are written: ``bench_verl.py`` and the verl integration tests (``tests/test_integration_verl.py``
and the tests that import from it) build their actor inputs with them.
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto
from verl.workers.config import FSDPActorConfig, PolicyLossConfig

from trustscope.integrations import verl as tv


def make_batch(B: int = 8, P: int = 4, T: int = 6, group: int = 2, seed: int = 0) -> tuple[DataProto, torch.Tensor]:
    """A driver batch shaped like verl's before the actor update, and pi ``(B, T)`` for the actor's forward.

    Prompts left-padded, responses right-padded with varying lengths, padding log-probs 0 as verl writes them,
    GRPO advantages broadcast over each response, one ``uid`` per group of ``group`` responses.
    """
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    resp_len = torch.randint(1, T + 1, (B,), generator=g)
    resp_len[0] = T
    prompt_mask = (torch.arange(P) >= (P - prompt_len)[:, None]).long()  # (B, P), left padding
    response_mask = (torch.arange(T) < resp_len[:, None]).long()  # (B, T), right padding
    prompts = torch.randint(3, 40, (B, P), generator=g) * prompt_mask
    responses = torch.randint(3, 40, (B, T), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp_min(0)
    old = -torch.rand(B, T, generator=g) * 3 * response_mask  # (B, T)
    rollout = (old + 0.4 * torch.randn(B, T, generator=g)).clamp(max=0) * response_mask
    pi = (old + 0.5 * torch.randn(B, T, generator=g)).clamp(max=-1e-3) * response_mask
    reward = torch.randint(0, 2, (B,), generator=g).float()
    grouped = reward.view(-1, group)
    seq_adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    seq_adv[1] = 0.0
    scores = torch.zeros(B, T)
    scores[torch.arange(B), resp_len - 1] = reward
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
            "position_ids": position_ids, "old_log_probs": old, "rollout_log_probs": rollout,
            "advantages": seq_adv[:, None] * response_mask, "token_level_scores": scores,
        },
        non_tensors={"uid": np.array([f"prompt-{i // group}" for i in range(B)], dtype=object)},
        meta_info={"temperature": 1.0},
    )
    return batch, pi


def model_output(micro, pi: torch.Tensor, entropy: torch.Tensor | None = None) -> dict:
    """What verl's engine hands the loss: log-probs over each whole unpadded sequence (nested), shifted by one."""

    def lengths(row: int) -> tuple[int, int]:
        if micro["prompts"].is_nested:  # V1's TransferQueue rows: one unpadded tensor per sample
            return len(micro["prompts"][row]), len(micro["responses"][row])
        P = micro["prompts"].shape[1]  # the response's own length: its attended tokens (tool turns and tokens a
        # rejection sampling masked out of the loss included), as verl's left_right_2_no_padding unpads it
        return int(micro["attention_mask"][row, :P].sum()), int(micro["attention_mask"][row, P:].sum())

    def nested(values: torch.Tensor):
        seqs = []
        for row, sid in enumerate(micro[tv.SAMPLE_KEY].tolist()):
            p, r = lengths(row)
            seqs.append(torch.cat([torch.full((p - 1,), -7.0), values[sid, :r], torch.full((1,), -7.0)]))
        return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)

    out = {"log_probs": nested(pi)}
    if entropy is not None:
        out["entropy"] = nested(entropy)
    return out


def actor_config(loss_mode: str, agg: str = "token-mean", **settings) -> FSDPActorConfig:
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                           loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode), **settings)
