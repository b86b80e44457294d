"""transformers ``generate`` behind the rollout-engine interface: the reference engine, and the one to use where
vLLM is not installed.

mu is the distribution the sampler drew from: ``log_softmax`` of the processed scores (after temperature and
top-p), the same convention as the vLLM engine's ``processed_logprobs``. HF's default ``top_k=50`` is switched off
(``top_k=0``): a silent top-50 truncation would make mu differ from the trainer's full softmax.
Rows of one call are sampled from torch's global generator inside ``torch.random.fork_rng``, seeded per call, so
the trainer's RNG stream is untouched and a call is reproducible from its seed.

Routing (``routing=True``, a mixture-of-experts model): forward hooks on the engine copy's own routers record the
experts every pass of ``generate`` chose (the prompt's prefill, then one row per decode step;
:meth:`trustscope.routing.TrainerRouting.take_forwards`), and each sample gets ``Rollout.routed_experts``: the
``(P_i + T_i - 1, L, k)`` ids of the positions its prompt and response went through, as the vLLM engine returns
them. They are the engine's side: the copy runs at the engine's dtype (``engine_dtype``), so against the trainer's
fp32 routers a bf16 engine's choices can differ.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from trustscope.engines.base import (
    DTYPES,
    Engine,
    Rollout,
    RolloutTensors,
    finalize_topk,
)


class HFEngine(Engine):
    """A private copy of the model in ``dtype`` sampled with ``model.generate``.

    ``num_threads``: torch threads during CPU rollouts (default 1: on a busy 2-core machine two threads stall on
    OpenMP barriers, measured 10x slower; None leaves the process setting). ``device``: where the copy lives
    (default: cuda when available, else cpu). ``routing``: record each sample's routed experts (an MoE model;
    ValueError for a dense one); ``"required"`` is accepted as the vLLM engine's value and means the same here.
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        seed: int = 0,
        *,
        num_threads: int | None = 1,
        device: str | None = None,
        routing: bool | str = False,
        logprobs_mode: str = "processed_logprobs",
    ) -> None:
        super().__init__(model_dir, dtype, seed, logprobs_mode)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.num_threads = num_threads if self.device.type == "cpu" else None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.eos_ids = self._eos_ids()
        self.routing = self._routing_capture() if routing else None

    def _routing_capture(self) -> Any:
        """Router hooks on the engine's copy (:class:`trustscope.routing.TrainerRouting`); ValueError when dense."""
        from trustscope.routing import TrainerRouting, moe_shape

        if moe_shape(self.model.config) is None:
            raise ValueError(f"routing=True: {self.model_dir} is a dense model (its config names no experts)")
        return TrainerRouting(self.model)

    def _routed(self) -> contextlib.AbstractContextManager[Any]:
        """Around one ``generate``: record every forward pass's experts when routing is on."""
        return contextlib.nullcontext() if self.routing is None else self.routing.hooked(forwards=True)

    def _routed_experts(self, batch: int, prompt_len: int, steps: int, prompt_lens: list[int],
                        lengths: list[int]) -> list[np.ndarray] | None:
        """Per sample, the ``(P_i + T_i - 1, L, k)`` int16 experts of the positions it fed: the generate's passes
        cover ``prompt_len + steps - 1`` columns of the left-padded batch (the last sampled token is never fed), and
        sample i's are the columns ``prompt_len - P_i .. prompt_len + T_i - 2``."""
        if self.routing is None:
            return None
        rows = self.routing.take_forwards(batch)  # (B, P + steps - 1, L, k)
        if rows.shape[1] != prompt_len + steps - 1:
            raise RuntimeError(f"HFEngine routing: generate's forward passes covered {rows.shape[1]} positions, "
                               f"expected {prompt_len} prompt + {steps} sampled - 1")
        return [rows[b, prompt_len - n_p: prompt_len + t - 1].copy()
                for b, (n_p, t) in enumerate(zip(prompt_lens, lengths, strict=True))]

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    @contextlib.contextmanager
    def _threads(self):
        previous = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != previous:
                torch.set_num_threads(previous)

    def _reported(self, out: Any) -> tuple[torch.Tensor, ...]:
        """Per generated position, the ``(B, V)`` scores mu is the softmax of: the processed scores the sampler
        drew from (temperature, top-k, top-p applied), or with ``logprobs_mode="raw_logprobs"`` the model's raw
        logits."""
        return out.logits if self.logprobs_mode == "raw_logprobs" else out.scores

    @torch.no_grad()
    def _sample(self, prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float, topk: int,
                seed: int, *, top_k: int = 0) -> Rollout:
        """Sample with ``model.generate``; see :meth:`Engine.generate`."""
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True).to(self.device)
        p = enc["input_ids"].shape[1]
        devices = [self.device] if self.device.type == "cuda" else []
        with self._threads(), torch.random.fork_rng(devices=devices), self._routed():
            torch.manual_seed(seed)
            out = self.model.generate(
                **enc, do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                max_new_tokens=max_tokens, num_return_sequences=n, output_scores=True, output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_ids,
            )
        gen = out.sequences[:, p:]  # (B, T), B = len(prompts) * n, grouped by prompt
        sampled_steps, ids_steps, lps_steps = [], [], []
        for t, scores in enumerate(self._reported(out)):  # one (B, V) step at a time: never a (B, T, V) copy
            step_lp = scores.float().log_softmax(-1)  # (B, V) of the distribution reported as mu
            sampled_steps.append(step_lp.gather(-1, gen[:, t, None])[:, 0])
            lps_t, ids_t = step_lp.topk(topk, dim=-1)  # (B, K), sorted descending
            ids_steps.append(ids_t)
            lps_steps.append(lps_t)
        sampled_lp = torch.stack(sampled_steps, 1)  # (B, T)
        topk_ids, topk_lps = torch.stack(ids_steps, 1), torch.stack(lps_steps, 1)  # (B, T, K)
        topk_ids, topk_lps = finalize_topk(topk_ids, topk_lps, gen, sampled_lp)
        is_eos = torch.isin(gen, torch.tensor(self.eos_ids, device=gen.device))  # (B, T)
        has_eos = is_eos.any(-1)  # (B,)
        lengths = torch.where(has_eos, is_eos.float().argmax(-1) + 1, torch.full_like(has_eos, gen.shape[1], dtype=torch.long))
        gen, sampled_lp, topk_ids, topk_lps = gen.cpu(), sampled_lp.cpu(), topk_ids.cpu(), topk_lps.cpu()
        prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu(), strict=True)]

        response_ids, mu, tk_ids, tk_lps = [], [], [], []
        for b in range(gen.shape[0]):
            t = int(lengths[b])
            response_ids.append(gen[b, :t].tolist())
            mu.append(sampled_lp[b, :t].tolist())
            tk_ids.append(topk_ids[b, :t].tolist())
            tk_lps.append(topk_lps[b, :t].tolist())
        fed = [len(prompt_ids[b // n]) for b in range(gen.shape[0])]
        routed = self._routed_experts(gen.shape[0], p, gen.shape[1], fed, [len(r) for r in response_ids])
        return Rollout(
            prompts=list(prompts), n=n, topk=topk, prompt_index=[b // n for b in range(gen.shape[0])],
            prompt_ids=[prompt_ids[b // n] for b in range(gen.shape[0])], response_ids=response_ids,
            mu_logprobs=mu, mu_topk_ids=tk_ids, mu_topk_logprobs=tk_lps,
            finish_reasons=["stop" if bool(e) else "length" for e in has_eos],
            texts=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            sampling=self.sampling_info() | {"seed": seed}, routed_experts=routed,
        )

    @torch.no_grad()
    def _extend(self, prompt_ids: list[list[int]], max_tokens: list[int], temperature: float, top_p: float,
                topk: int, seed: int, stop_token_ids: list[int] | None = None, *, top_k: int = 0) -> Rollout:
        """Continue token-id sequences with ``model.generate`` (left-padded ids, no text); see :meth:`Engine.extend`.
        Every row samples ``max(max_tokens)`` steps; row i keeps its first ``max_tokens[i]`` (up to its EOS)."""
        b, p = len(prompt_ids), max(len(ids) for ids in prompt_ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((b, p), pad, dtype=torch.long)  # (B, P) left-padded
        attention = torch.zeros((b, p), dtype=torch.long)  # (B, P)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, p - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention[i, p - len(ids):] = 1
        ends = [*self.eos_ids, *(i for i in stop_token_ids or () if i not in self.eos_ids)]  # stop ids end a row too
        devices = [self.device] if self.device.type == "cuda" else []
        with self._threads(), torch.random.fork_rng(devices=devices), self._routed():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), do_sample=True,
                temperature=float(temperature), top_p=float(top_p), top_k=top_k, max_new_tokens=max(max_tokens),
                output_scores=True, output_logits=True, return_dict_in_generate=True, pad_token_id=pad,
                eos_token_id=ends,
            )
        gen = out.sequences[:, p:]  # (B, T)
        scores = torch.stack([s.float().log_softmax(-1) for s in self._reported(out)], 1)  # (B, T, V) mu
        sampled_lp = scores.gather(-1, gen[..., None])[..., 0]  # (B, T)
        lps, ids = scores.topk(topk, dim=-1)  # (B, T, K)
        ids, lps = finalize_topk(ids, lps, gen, sampled_lp)
        is_eos = torch.isin(gen, torch.tensor(ends, device=gen.device)).cpu()  # (B, T)
        gen, sampled_lp, ids, lps = gen.cpu(), sampled_lp.cpu(), ids.cpu(), lps.cpu()
        response_ids, finish, mu, tk_ids, tk_lps = [], [], [], [], []
        for i in range(b):
            t = min(max_tokens[i], gen.shape[1])
            stops = is_eos[i, :t].nonzero()
            stopped = len(stops) > 0
            t = int(stops[0]) + 1 if stopped else t
            response_ids.append(gen[i, :t].tolist())
            finish.append("stop" if stopped else "length")
            mu.append(sampled_lp[i, :t].tolist())
            tk_ids.append(ids[i, :t].tolist())
            tk_lps.append(lps[i, :t].tolist())
        routed = self._routed_experts(b, p, gen.shape[1], [len(ids) for ids in prompt_ids],
                                      [len(r) for r in response_ids])
        return Rollout(
            prompts=self.tokenizer.batch_decode(prompt_ids), n=1, topk=topk, prompt_index=list(range(b)),
            prompt_ids=prompt_ids, response_ids=response_ids, mu_logprobs=mu, mu_topk_ids=tk_ids,
            mu_topk_logprobs=tk_lps, finish_reasons=finish,
            texts=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            sampling=self.sampling_info() | {"seed": seed}, routed_experts=routed,
        )

    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s weights into the engine's copy (cast to the engine's dtype)."""
        self.model.load_state_dict(model.state_dict())

    @torch.no_grad()
    def score(self, rollout: Rollout, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, RolloutTensors]:
        """Teacher-forced logprobs of a rollout's tokens under this engine's model (one forward pass).

        Returns ``(logprob (B, T), topk_logprobs (B, T, K) at the rollout's mu top-K ids, tensors)``, both
        float32 and zero beyond each response (``tensors.mask``), with logits divided by ``temperature``.
        """
        tensors = rollout.to_tensors(pad_id=self.tokenizer.pad_token_id)
        p, t = tensors.prompt_len, tensors.response_ids.shape[1]
        with self._threads():
            logits = self.model(
                input_ids=tensors.input_ids.to(self.device),
                attention_mask=tensors.attention_mask.to(self.device),
                position_ids=tensors.position_ids.to(self.device),
            ).logits[:, p - 1 : p + t - 1]  # (B, T, V)
        logprobs = (logits.float() / temperature).log_softmax(-1).cpu()  # (B, T, V)
        mask = tensors.mask
        lp = logprobs.gather(-1, tensors.response_ids[..., None])[..., 0] * mask  # (B, T)
        topk = logprobs.gather(-1, tensors.mu_topk_ids) * mask[..., None]  # (B, T, K)
        return lp, topk, tensors

    def sampling_info(self) -> dict[str, Any]:
        import transformers

        return super().sampling_info() | {"transformers_version": transformers.__version__, "device": str(self.device)}

    def close(self) -> None:
        self.__dict__.pop("model", None)
