"""A prime-rl token export for the importer benchmarks, written as prime-rl's ``TokenExporter`` writes it.

The one writer of such exports: the importer benchmarks and the importer tests (``tests/test_importers_prime_rl.py``,
the follow tests) both write through it. ``PrimeRLExporter`` follows ``src/prime_rl/trainer/rl/token_export.py``
(PrimeIntellect-ai/prime-rl): packed micro-batches ``(1, L)``, columns through ``tolist()`` with non-finite floats
as ``null``, absent tensors as lists of ``null``, trailing padding (``env_names == ""`` and no loss mask) trimmed,
one compact JSON line per sequence with a loss-mask token, ``STABLE`` touched per finished step. The trainer's
log-probs and entropy are shifted right with prime-rl's pad values (``log(1/V)``, ``log V``) at position 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

V = 64  # vocab of the fake model
DPPO_LOW, DPPO_HIGH = 0.2, 0.2


@dataclass
class Rollout:
    """One sampled sequence as the orchestrator hands it to the trainer."""

    prompt: list[int]
    completion: list[int]
    trained: list[bool]  # loss mask over the completion (False: environment tokens of a multi-turn rollout)
    mu: list[float]  # inference log-probs over the completion
    pi: list[float]  # trainer log-probs over the completion (what the forward will return)
    entropy: list[float]
    advantage: float
    env: str = "math"
    reward: float = 0.0


def make_rollouts(rng: np.random.Generator, n: int, prompt_len: int = 5, completion_len: int = 12,
                  group: int = 4) -> list[Rollout]:
    out = []
    for i in range(n):
        if i % group == 0:
            prompt = rng.integers(0, V, prompt_len).tolist()
            rewards = rng.integers(0, 2, group).astype(float)
            adv = rewards - rewards.mean()
        length = int(rng.integers(completion_len // 2, completion_len + 1))
        mu = np.log(rng.uniform(0.02, 1.0, length))
        pi = np.minimum(mu + rng.normal(0, 0.3, length), 0.0)
        trained = [True] * length
        if i % 3 == 1 and length > 4:  # a tool turn inside the completion
            trained[2:4] = [False, False]
        out.append(Rollout(prompt, rng.integers(0, V, length).tolist(), trained, mu.tolist(), pi.tolist(),
                           rng.uniform(0.1, 3.0, length).tolist(), float(adv[i % group]),
                           reward=float(rewards[i % group])))
    return out


def pack(rollouts: list[Rollout], pad_to: int) -> tuple[dict, dict, list[int]]:
    """A packed micro-batch ``(1, L)`` and the model output, as prime-rl's trainer has them before ``export``."""
    ids, pos, mask, adv, inf, env, pi, ent, rw = [], [], [], [], [], [], [], [], []
    lengths = []
    for r in rollouts:
        n_p, n_c = len(r.prompt), len(r.completion)
        ids += r.prompt + r.completion
        pos += list(range(n_p + n_c))
        mask += [False] * n_p + r.trained
        adv += [r.advantage] * (n_p + n_c)
        inf += [0.0] * n_p + r.mu
        env += [r.env] * (n_p + n_c)
        pi += [-0.5] * n_p + r.pi
        ent += [1.0] * n_p + r.entropy
        rw += [r.reward] * (n_p + n_c)
        lengths.append(n_p + n_c)
    pad = pad_to - len(ids)
    ids, pos, mask, adv, inf, pi, ent, rw = (ids + [0] * pad, pos + list(range(pad)), mask + [False] * pad,
                                             adv + [0.0] * pad, inf + [0.0] * pad, pi + [0.0] * pad,
                                             ent + [0.0] * pad, rw + [0.0] * pad)
    env += [""] * pad
    lengths[-1] += pad  # the packer gives the padding to the last sample
    # the trainer's shift_tensor_right: position 0 gets log(1/V) / log(V)
    pi = [math.log(1.0 / V), *pi[1:]]
    ent = [math.log(V), *ent[1:]]
    t = torch.tensor
    micro_batch = {"input_ids": t([ids]), "position_ids": t([pos]), "loss_mask": t([mask]),
                   "advantages": t([adv], dtype=torch.float32), "inference_logprobs": t([inf], dtype=torch.float32),
                   "env_names": env, "rewards": t([rw], dtype=torch.float32)}
    model_output = {"logprobs": t([pi], dtype=torch.float32), "entropy": t([ent], dtype=torch.float32)}
    return micro_batch, model_output, lengths


def _floats(x: torch.Tensor | None, n: int) -> list:
    if x is None:
        return [None] * n
    return [v if math.isfinite(v) else None for v in x.detach().to(torch.float32).reshape(-1).tolist()]


def _bools(x: torch.Tensor | None, n: int) -> list:
    return [None] * n if x is None else [bool(v) for v in x.reshape(-1).tolist()]


class PrimeRLExporter:
    """Writes ``token_exports/step_N/rank_R.jsonl`` as prime-rl's TokenExporter does (``layout`` picks the version)."""

    def __init__(self, output_dir: Path, rank: int, layout: str = "weight-stream", dppo: bool = True,
                 run_id: str | None = None):
        # the loss-channel layout (prime-rl's loss-channel branch) writes a named run under <run_id>/token_exports
        self.root = (output_dir if run_id is None else output_dir / run_id) / "token_exports"
        self.rank, self.layout, self.dppo, self.run_id = rank, layout, dppo, run_id
        self.counts: dict[int, int] = {}
        self.opened: set[int] = set()

    def columns(self, mb: dict, out: dict) -> dict:
        n = mb["input_ids"].numel()
        trainer, inference = out["logprobs"], mb["inference_logprobs"]
        log_ratio = trainer - inference
        ratio = torch.exp(log_ratio)
        delta = torch.exp(trainer) - torch.exp(inference)
        masked = high = low = None
        if self.dppo:
            pos, neg = mb["advantages"] > 0, mb["advantages"] < 0
            inv_high, inv_low = delta > DPPO_HIGH, delta < -DPPO_LOW
            masked = mb["loss_mask"] & torch.where(pos, inv_high, inv_low)
            high, low = mb["loss_mask"] & pos & inv_high, mb["loss_mask"] & neg & inv_low
        cols = {
            "token_ids": [int(v) for v in mb["input_ids"].reshape(-1).tolist()],
            "position_ids": [int(v) for v in mb["position_ids"].reshape(-1).tolist()],
            "loss_mask": _bools(mb["loss_mask"], n),
            "advantages": _floats(mb["advantages"], n),
        }
        if self.layout == "loss-channel":  # one "rl" channel: its values are the advantages, its mask the loss mask
            cols["losses"] = [{"rl": {"advantage": a, "mask": m}}
                              for a, m in zip(cols["advantages"], cols["loss_mask"], strict=True)]
        if self.layout in ("training-mode", "loss-channel"):
            cols["rewards"] = _floats(mb["rewards"], n)
        cols.update({
            "inference_logprobs": _floats(inference, n), "trainer_logprobs": _floats(trainer, n),
            "entropy": _floats(out["entropy"], n), "mismatch_kl": _floats(ratio - log_ratio - 1, n),
            "log_importance_ratio": _floats(log_ratio, n), "importance_ratio": _floats(ratio, n),
            "prob_delta": _floats(delta, n), "is_masked": _bools(masked, n), "is_masked_high": _bools(high, n),
            "is_masked_low": _bools(low, n),
        })
        if self.layout == "weight-stream":
            cols.update(rl_weights=[None] * n, ce_weights=[None] * n, ref_kl_weights=[None] * n)
        cols["env_names"] = list(mb["env_names"])
        return cols

    def export(self, step: int, micro_step: int, mb: dict, out: dict, lengths: list[int]) -> None:
        cols = self.columns(mb, out)
        start = 0
        for idx, length in enumerate(lengths):
            raw_end = start + length
            end = raw_end
            while end > start and cols["env_names"][end - 1] == "" and not cols["loss_mask"][end - 1]:
                end -= 1
            if end > start and any(cols["loss_mask"][start:end]):
                record = {"schema_version": 1, "step": step, "rank": self.rank, "micro_step": micro_step,
                          "micro_sequence_idx": idx, "export_sequence_idx": self.counts.get(step, 0),
                          "env_name": next((e for e in cols["env_names"][start:end] if e), None)}
                if self.layout == "loss-channel":
                    record = {"schema_version": 1, "step": step, "export_step": step, "rank": self.rank,
                              "micro_step": micro_step, "micro_sequence_idx": idx,
                              "export_sequence_idx": self.counts.get(step, 0), "run_id": self.run_id,
                              "env_name": record["env_name"]}
                if self.layout == "training-mode":
                    record["training_mode"] = "rl"
                record.update({k: list(v[start:end]) for k, v in cols.items() if k != "env_names"})
                step_dir = self.root / f"step_{step}"
                step_dir.mkdir(parents=True, exist_ok=True)
                with (step_dir / f"rank_{self.rank}.jsonl").open("a" if step in self.opened else "w") as f:
                    f.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
                self.opened.add(step)
                self.counts[step] = self.counts.get(step, 0) + 1
            start = raw_end

    def mark_stable(self, step: int) -> None:
        (self.root / f"step_{step}" / "STABLE").touch()
