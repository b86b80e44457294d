"""The rollout-engine interface: one ``generate`` that returns the sampler's own logprobs, one ``update_weights``.

Every engine returns a :class:`Rollout`: ragged per-sample lists, exactly as sampled, plus
:meth:`Rollout.to_tensors` for the trainer. ``mu`` is always the distribution the sampler actually drew from
(after temperature and top-p), and mu's top-K set always holds the sampled token (PAPER.md, "Top-K": where the
sampled token is missing it replaces the K-th entry, :func:`trustscope.divergence.force_sampled_into_topk`).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trustscope.extras import missing

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.engines.base")

from trustscope.divergence import force_sampled_into_topk

LOGPROB_FLOOR = -1.0e4
"""Top-K logprobs of tokens the sampler could not draw (outside the top-p nucleus: ``-inf``) are stored as this
finite floor, so ``0 * log 0`` terms downstream stay 0 instead of NaN. ``exp(-1e4)`` is 0 in float32."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Parameter dtypes of the trainer and the engines, by the name a config gives them."""
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
"""What an engine reports as mu (vLLM's ``logprobs_mode`` names): ``processed_logprobs``, the distribution the
sampler drew from (after temperature, top-k and top-p: the default, and what the trainer's pi is compared with);
``raw_logprobs``, the model's untempered, untruncated softmax (vLLM's own default), which differs from what was
sampled wherever ``temperature != 1`` or a truncation is on: the sampling-processor mismatch ``trustscope
explain`` detects, available here so that a run can carry it on purpose."""


@dataclass(frozen=True)
class RolloutTensors:
    """A :class:`Rollout` padded into tensors, one row per sample (B = number of samples).

    The trainer's forward runs on ``input_ids`` (prompts left-padded to a common length P, responses right-padded
    to T) with ``attention_mask`` and ``position_ids``; the logits at positions ``P - 1 .. P + T - 2`` predict the
    response tokens, i.e. ``logits[:, P - 1 : P + T - 1]`` lines up with ``response_ids``.
    """

    response_ids: Tensor  # (B, T) long, pad_id beyond each response
    mu_logprob: Tensor  # (B, T) float32, 0 beyond each response
    mu_topk_ids: Tensor  # (B, T, K) long, pad_id beyond each response
    mu_topk_logprobs: Tensor  # (B, T, K) float32, LOGPROB_FLOOR beyond each response
    mask: Tensor  # (B, T) bool, True on response tokens the engine sampled (the EOS token included)
    input_ids: Tensor  # (B, P + T) long, prompt left-padded then response right-padded
    attention_mask: Tensor  # (B, P + T) long, 1 on real tokens
    position_ids: Tensor  # (B, P + T) long, counted from each prompt's first real token
    prompt_len: int  # P
    turn: Tensor | None = None  # (B, T) int32, the model turn of each token (multi-turn rollouts), 0 beyond
    engine_ids: Tensor | None = None  # (B, T) long, the id the engine returned at each sampled token, -1 elsewhere

    @property
    def response_lengths(self) -> Tensor:
        """Number of response tokens per sample, ``(B,)`` long."""
        return self.mask.sum(-1)


@dataclass
class Rollout:
    """Samples from one ``generate`` call: B = len(prompts) * n samples, grouped by prompt (the n samples of
    prompt i are rows ``i * n .. i * n + n - 1``). Every list below has one entry per sample.

    ``response_ids`` include the EOS token when the response stopped on it (``finish_reasons[i] == "stop"``).
    ``mu_logprobs[i][t]`` is the log-probability of ``response_ids[i][t]`` under the distribution the sampler
    drew from. ``mu_topk_ids[i][t]`` are K token ids sorted by descending mu logprob with the sampled token
    forced in, ``mu_topk_logprobs[i][t]`` their mu logprobs.
    """

    prompts: list[str]  # the distinct prompts, as passed to generate
    n: int  # samples per prompt
    topk: int  # K
    prompt_index: list[int]  # index into prompts
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    mu_logprobs: list[list[float]]
    mu_topk_ids: list[list[list[int]]]
    mu_topk_logprobs: list[list[list[float]]]
    finish_reasons: list[str]  # "stop": ended with the EOS token (its last token); "length": max_tokens
    texts: list[str]  # decoded response, special tokens (EOS) skipped
    sampling: dict[str, Any] = field(default_factory=dict)  # what the sampler used, see Engine.sampling_info
    routed_experts: list[Any] | None = None  # MoE, engine routing on: (P_i + T_i - 1, L, k) int16 ids per sample
    # multi-turn rollouts (trustscope.train.multiturn); None for one model turn:
    sampled: list[list[bool]] | None = None  # per token: False on the environment's tokens spliced in
    turns: list[list[int]] | None = None  # per token: the model turn (0, 1, ...)
    engine_ids: list[list[int]] | None = None  # per token: the id the engine returned, -1 on the environment's

    def __post_init__(self) -> None:
        b = len(self.response_ids)
        for name in ("prompt_index", "prompt_ids", "mu_logprobs", "mu_topk_ids", "mu_topk_logprobs",
                     "finish_reasons", "texts"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"Rollout.{name} has {len(getattr(self, name))} entries, expected {b}")
        per_token = [name for name in ("sampled", "turns", "engine_ids") if getattr(self, name) is not None]
        for name in per_token:
            if len(getattr(self, name)) != b:
                raise ValueError(f"Rollout.{name} has {len(getattr(self, name))} entries, expected {b}")
        for i in range(b):
            t = len(self.response_ids[i])
            if len(self.mu_logprobs[i]) != t or len(self.mu_topk_ids[i]) != t or len(self.mu_topk_logprobs[i]) != t \
                    or any(len(getattr(self, name)[i]) != t for name in per_token):
                raise ValueError(f"Rollout sample {i}: per-token lists disagree with {t} response tokens")

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        """Total number of response tokens over all samples."""
        return sum(len(r) for r in self.response_ids)

    def to_tensors(self, pad_id: int = 0) -> RolloutTensors:
        """Pad into tensors (see :class:`RolloutTensors`); ``pad_id`` fills ids beyond each sequence."""
        b, k = len(self), self.topk
        t = max((len(r) for r in self.response_ids), default=0)
        p = max((len(q) for q in self.prompt_ids), default=0)
        response_ids = torch.full((b, t), pad_id, dtype=torch.long)  # (B, T)
        mu_logprob = torch.zeros((b, t), dtype=torch.float32)  # (B, T)
        topk_ids = torch.full((b, t, k), pad_id, dtype=torch.long)  # (B, T, K)
        topk_lps = torch.full((b, t, k), LOGPROB_FLOOR, dtype=torch.float32)  # (B, T, K)
        mask = torch.zeros((b, t), dtype=torch.bool)  # (B, T)
        input_ids = torch.full((b, p + t), pad_id, dtype=torch.long)  # (B, P + T)
        attention_mask = torch.zeros((b, p + t), dtype=torch.long)  # (B, P + T)
        turn, engine_ids = self._turn_tensors(t)
        for i in range(b):
            n_t, n_p = len(self.response_ids[i]), len(self.prompt_ids[i])
            if n_t:
                response_ids[i, :n_t] = torch.tensor(self.response_ids[i], dtype=torch.long)
                mu_logprob[i, :n_t] = torch.tensor(self.mu_logprobs[i], dtype=torch.float32)
                topk_ids[i, :n_t] = torch.tensor(self.mu_topk_ids[i], dtype=torch.long)
                topk_lps[i, :n_t] = torch.tensor(self.mu_topk_logprobs[i], dtype=torch.float32)
                mask[i, :n_t] = True if self.sampled is None else torch.tensor(self.sampled[i], dtype=torch.bool)
            input_ids[i, p - n_p : p] = torch.tensor(self.prompt_ids[i], dtype=torch.long)
            input_ids[i, p : p + t] = response_ids[i]
            attention_mask[i, p - n_p : p + n_t] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # (B, P + T)
        return RolloutTensors(response_ids, mu_logprob, topk_ids, topk_lps, mask, input_ids, attention_mask,
                              position_ids, p, turn=turn, engine_ids=engine_ids)

    def _turn_tensors(self, t: int) -> tuple[Tensor | None, Tensor | None]:
        """A multi-turn rollout's ``(B, T)`` turn and engine-id tensors (None, None for one model turn). Beside
        them, :meth:`to_tensors` sets the response mask False where ``sampled`` is, so the environment's tokens stay
        in the trainer's input but out of the loss and the log."""
        if self.sampled is None and self.turns is None and self.engine_ids is None:
            return None, None
        b = len(self)
        turn = torch.zeros((b, t), dtype=torch.int32)  # (B, T)
        engine_ids = torch.full((b, t), -1, dtype=torch.long)  # (B, T)
        for i in range(b):
            n_t = len(self.response_ids[i])
            if self.turns is not None and n_t:
                turn[i, :n_t] = torch.tensor(self.turns[i], dtype=torch.int32)
            if self.engine_ids is not None and n_t:
                engine_ids[i, :n_t] = torch.tensor(self.engine_ids[i], dtype=torch.long)
        return turn, engine_ids


def finalize_topk(
    topk_ids: Tensor, topk_logprobs: Tensor, sampled_ids: Tensor, sampled_logprobs: Tensor
) -> tuple[Tensor, Tensor]:
    """mu's top-K lists as stored: the sampled token forced in (PAPER.md rule), ``-inf`` floored.

    ``topk_ids``/``topk_logprobs`` ``(..., K)`` sorted by descending logprob, ``sampled_*`` ``(...)``.
    Returns ``(ids, logprobs)`` ``(..., K)``, still sorted (a forced-in token ranks below the K-1 it joins).
    """
    ids, lps = force_sampled_into_topk(topk_ids, topk_logprobs, sampled_ids, sampled_logprobs)
    return ids, lps.float().clamp_min(LOGPROB_FLOOR)


def check_sampling_args(
    prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float, topk: int, vocab_size: int,
    top_k: int = 0,
) -> None:
    """Raise ``ValueError`` naming the field and the value for arguments no engine can honour."""
    if not isinstance(prompts, list | tuple) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (greedy decoding has no mu), got {temperature!r}")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(topk, int) or not 1 <= topk <= vocab_size:
        raise ValueError(f"topk must be an integer in [1, vocab size {vocab_size}], got {topk!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be an integer in [0, vocab size {vocab_size}] (0: no top-k truncation), "
                         f"got {top_k!r}")


def warn_if_biased(temperature: float, top_p: float, top_k: int = 0) -> None:
    """Warn when the sampled distribution is not the model's own softmax, so ``pi / mu`` needs care.

    mu is reported as the distribution actually sampled from (after temperature and top-p). With
    ``temperature != 1`` the trainer must divide its logits by the same temperature, or every ratio is biased.
    With ``top_p < 1`` the truncated, renormalised mu cannot be reproduced by the trainer's full softmax at all:
    every kept token's ratio is biased by the nucleus mass (``pi / mu <= nucleus mass``).
    """
    if top_k > 0:
        warnings.warn(
            f"top_k={top_k}: mu is renormalised over the {top_k} likeliest tokens; the trainer's full-softmax pi is "
            f"not comparable to it unless it applies the same truncation (keep_sampling_mask).",
            UserWarning,
            stacklevel=3,
        )
    if top_p < 1.0:
        warnings.warn(
            f"top_p={top_p} < 1: mu is the renormalised nucleus distribution; the trainer's full-softmax pi is not "
            f"comparable to it, so pi/mu and every trust-region mask are biased. Use top_p=1.0 for RL.",
            UserWarning,
            stacklevel=3,
        )
    if temperature != 1.0:
        warnings.warn(
            f"temperature={temperature} != 1: mu is softmax(logits / {temperature}); the trainer must compute pi "
            f"with the same temperature or pi/mu is biased.",
            UserWarning,
            stacklevel=3,
        )


def request_seeds(seed: int, count: int) -> list[int]:
    """``count`` independent 31-bit seeds derived from one seed (one per prompt)."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32) >> 1]


class Engine(ABC):
    """A rollout engine. Build one with :func:`trustscope.engines.make_engine`."""

    name: str = ""

    def __init__(self, model_dir: str, dtype: str = "float32", seed: int = 0,
                 logprobs_mode: str = "processed_logprobs") -> None:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.seed = seed
        self._seed_rng = np.random.default_rng(seed)
        self._last: dict[str, Any] = {}

    def next_seed(self, seed: int | None) -> int:
        """The seed of one generate call: ``seed`` as given, else the next one from the engine's own stream."""
        return int(self._seed_rng.integers(0, 2**31 - 1)) if seed is None else int(seed)

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        max_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        topk: int = 20,
        seed: int | None = None,
        top_k: int = 0,
    ) -> Rollout:
        """Sample ``n`` responses per prompt; return them with mu's logprobs and top-K (see :class:`Rollout`).

        Reproducible for a given ``seed``; ``seed=None`` draws the next seed from the engine's seeded stream.
        Arguments are checked here, once for every engine; a biased sampler (``top_p < 1``, ``temperature != 1``)
        is warned about. ``top_k``: sample from the ``top_k`` likeliest tokens only (0: off; ``topk`` is the number
        of mu's log-probs returned per position).
        """
        check_sampling_args(prompts, n, max_tokens, temperature, top_p, topk, self.vocab_size, top_k)
        warn_if_biased(temperature, top_p, top_k)
        self._last = {"temperature": temperature, "top_p": top_p, "topk": topk, "top_k": top_k}
        return self._sample(list(prompts), n, max_tokens, temperature, top_p, topk, self.next_seed(seed), top_k=top_k)

    @abstractmethod
    def _sample(self, prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float, topk: int,
                seed: int, *, top_k: int = 0) -> Rollout:
        """The engine's own sampling, on checked arguments and a resolved seed."""

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """The token ids of each prompt as the engine's tokenizer writes them (what ``generate`` would sample after)."""
        return [list(self.tokenizer(p)["input_ids"]) for p in prompts]

    def extend(
        self,
        prompt_ids: list[list[int]],
        max_tokens: list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        topk: int = 20,
        seed: int | None = None,
        stop_token_ids: list[int] | tuple[int, ...] = (),
        top_k: int = 0,
    ) -> Rollout:
        """Continue each token-id sequence ``prompt_ids[i]`` by at most ``max_tokens[i]`` new tokens (one sample each).

        A partial rollout's next chunk: the sequence so far (prompt then the response's sampled ids) goes in as ids,
        never re-tokenized text, and the new tokens come back with mu's logprobs and top-K under the weights the
        engine holds now. ``finish_reasons[i]`` is ``"stop"`` when the chunk ended on EOS, else ``"length"``.
        ``stop_token_ids`` end a sequence as EOS does, kept as its last token (``"stop"`` too): a multi-turn
        rollout's model turn ends on the token that closes a tool call (:mod:`trustscope.train.multiturn`).
        """
        if not prompt_ids or len(max_tokens) != len(prompt_ids):
            raise ValueError(f"extend: {len(prompt_ids)} sequences and {len(max_tokens)} max_tokens; give one "
                             f"max_tokens per sequence, at least one sequence")
        for i, (ids, m) in enumerate(zip(prompt_ids, max_tokens, strict=True)):
            if not ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"extend: sequence {i} must be a non-empty list of token ids in [0, {self.vocab_size})")
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"extend: max_tokens[{i}] must be an integer >= 1, got {m!r}")
        check_sampling_args(["ids"], 1, 1, temperature, top_p, topk, self.vocab_size, top_k)
        warn_if_biased(temperature, top_p, top_k)
        self._last = {"temperature": temperature, "top_p": top_p, "topk": topk, "top_k": top_k}
        return self._extend([list(ids) for ids in prompt_ids], list(max_tokens), temperature, top_p, topk,
                            self.next_seed(seed), stop_token_ids=list(stop_token_ids), top_k=top_k)

    def _extend(self, prompt_ids: list[list[int]], max_tokens: list[int], temperature: float, top_p: float,
                topk: int, seed: int, stop_token_ids: list[int] | None = None, *, top_k: int = 0) -> Rollout:
        """The engine's own continuation of token-id sequences (see :meth:`extend`)."""
        raise NotImplementedError(f"engine {self.name!r} cannot continue token-id sequences (partial rollouts); "
                                  f"use engine vllm or hf")

    @abstractmethod
    def update_weights(self, model: torch.nn.Module) -> None:
        """Load the weights of ``model`` (a Hugging Face causal LM of the same architecture) into the engine."""

    def sampling_info(self) -> dict[str, Any]:
        """What the sampler does, for the run manifest: engine, dtype, logprobs_mode, and the temperature / top_p /
        top_k / K of the last generate call (None before the first)."""
        return {
            "engine": self.name,
            "model_dir": self.model_dir,
            "dtype": self.dtype,
            "logprobs_mode": self.logprobs_mode,
            "temperature": self._last.get("temperature"),
            "top_p": self._last.get("top_p"),
            "top_k": self._last.get("top_k", 0),
            "topk_logprobs": self._last.get("topk"),
            "seed": self.seed,
        }

    @abstractmethod
    def close(self) -> None:
        """Free the engine's resources. Idempotent."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
