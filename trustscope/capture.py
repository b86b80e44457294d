"""Trainer-side capture: from a causal LM's logits to what trustscope logs and the losses need.

For each response token: pi's logprob of the sampled token (differentiable: the loss uses it), pi's logprobs at
mu's top-K ids (differentiable too), and the entropy of pi (detached), all in float32. The work is chunked over
tokens: at V = 152k no second ``(N, V)`` tensor is made beside the logits, in the forward or the saved state; only
the backward writes the logits' gradient, which autograd needs anyway.

Alignment: for a causal LM fed ``input_ids`` ``(B, L)`` = prompt + response, the logits at column ``j`` predict
token ``j + 1``. A response that starts at column ``s_b`` of row ``b`` has its token ``t`` predicted by the logits at
column ``s_b - 1 + t``. ``response_start`` is that ``s_b``: an int (left-padded prompts of one width P) or ``(B,)``.

Two ways to use it::

    # 1. call it on logits the trainer already has
    cap = capture(out.logits, response_ids, response_start=P, mu_topk_ids=rollout.mu_topk_ids)
    loss = rule(PolicyBatch(pi_logprob=cap.logprob, ...))

    # 2. attach it to any Hugging Face causal LM; the loss code does not change
    with CaptureHook(model, response_ids, response_start=P, mu_topk_ids=ids) as hook:
        out = model(input_ids, attention_mask=attention_mask)
        loss = user_loss(out.logits, ...)
    cap = hook.result   # detached unless CaptureHook(..., keep_grad=True)

Temperature: a sampler at temperature ``tau`` draws from ``softmax(logits / tau)``, and the log-probs it reports
(vLLM's ``processed_logprobs``, TRL's training forward) are of that distribution; pass ``temperature=tau`` so pi is
measured on the same distribution as mu. ``temperature=1`` (the default) is the raw model.

A model whose forward returns no logits (TRL's fused LM head returns ``FusedCausalLMOutput``: log-probs and entropy
of the labels only) cannot be captured from; :class:`CaptureHook` refuses it when it is opened
(:class:`NoLogitsError`), and names what to use instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trustscope.extras import missing

try:
    import torch
    from torch import Tensor
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.capture")

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: a chunk's float32 copy of the logits is ``chunk x V`` (1024 x 152k x 4 B = 620 MB)."""


class NoLogitsError(TypeError):
    """The hooked model's output carries no ``(B, L, V)`` logits, so there is nothing to capture from."""


@dataclass
class Capture:
    """What :func:`capture` returns. B sequences, T response positions, K top-K ids.

    Attributes:
        logprob: ``(B, T)`` float32 log pi of the sampled token; carries gradients to the logits.
        entropy: ``(B, T)`` float32 entropy of pi at each position (nats), detached.
        topk_logprobs: ``(B, T, K)`` float32 log pi at mu's top-K ids (None when no ids were given).
    """

    logprob: Tensor
    entropy: Tensor
    topk_logprobs: Tensor | None = None

    def detach(self) -> Capture:
        tk = None if self.topk_logprobs is None else self.topk_logprobs.detach()
        return Capture(self.logprob.detach(), self.entropy.detach(), tk)


def _chunks(n: int, size: int) -> range:
    return range(0, n, size)


class _GatherLogprobs(torch.autograd.Function):
    """log_softmax of ``scale * logits`` gathered at given ids of selected rows of a ``(M, V)`` matrix, chunked.

    forward(logits (M, V), rows (N,), ids (N, J), chunk, scale) -> (logprobs (N, J) float32, entropy (N,) float32).
    ``scale`` is ``1 / temperature``. Saves only the logits (by reference), the indices and the log-normaliser
    ``(N,)``; backward recomputes the softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, rows: Tensor, ids: Tensor, chunk: int,
                scale: float) -> tuple[Tensor, Tensor]:
        n = rows.shape[0]
        out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)  # (N, J)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        for start in _chunks(n, chunk):
            sl = slice(start, start + chunk)
            x = logits.index_select(0, rows[sl]).float()  # (c, V)
            if scale != 1.0:
                x.mul_(scale)
            c_lse = torch.logsumexp(x, dim=-1)  # (c,)
            out[sl] = x.gather(1, ids[sl]) - c_lse[:, None]
            x.sub_(c_lse[:, None])  # log p, in place
            entropy[sl] = -(x.exp() * x).sum(-1)
            lse[sl] = c_lse
        ctx.save_for_backward(logits, rows, ids, lse)
        ctx.chunk = chunk
        ctx.scale = scale
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        logits, rows, ids, lse = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)  # (M, V)
        grad_out = grad_out.float()
        for start in _chunks(rows.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            x = logits.index_select(0, rows[sl]).float()  # (c, V)
            if ctx.scale != 1.0:
                x.mul_(ctx.scale)
            g_ids = grad_out[sl]  # (c, J)
            # d log p_j / d x_i = 1[i = j] - p_i, for the scaled logits x; the chain rule adds the scale
            g = x.sub_(lse[sl, None]).exp_().mul_(-g_ids.sum(-1, keepdim=True))  # (c, V)
            g.scatter_add_(1, ids[sl], g_ids)
            if ctx.scale != 1.0:
                g.mul_(ctx.scale)
            grad_logits.index_add_(0, rows[sl], g.to(logits.dtype))
        return grad_logits, None, None, None, None


def response_rows(logits_shape: torch.Size, response_start: int | Tensor, T: int, device: torch.device) -> Tensor:
    """Row indices ``(B, T)`` into ``logits.reshape(B * L, V)`` of the logits that predict each response token.

    Positions past the end of the sequence (padding) are clamped to the last column; mask them out.
    """
    B, L = logits_shape[0], logits_shape[1]
    start = torch.as_tensor(response_start, device=device).reshape(-1)  # (B,) or (1,)
    if start.numel() not in (1, B):
        raise ValueError(f"response_start must be an int or have shape (B,) = ({B},), got {tuple(start.shape)}")
    if (start < 1).any() or (start > L).any():
        raise ValueError(f"response_start must be in [1, L] = [1, {L}] (the logits before the response's first "
                         f"token), got {start.tolist()}")
    col = (start.reshape(-1, 1) - 1 + torch.arange(T, device=device)).clamp(max=L - 1)  # (B, T)
    col = col.expand(B, T)
    return torch.arange(B, device=device)[:, None] * L + col  # (B, T)


def _inverse_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return 1.0 / t


def capture(
    logits: Tensor,
    response_ids: Tensor,
    *,
    response_start: int | Tensor | None = None,
    mu_topk_ids: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
) -> Capture:
    """pi's logprob of each response token, at mu's top-K ids, and the entropy, chunked over tokens.

    Args:
        logits: ``(B, L, V)`` logits of a causal LM (any float dtype; math is float32).
        response_ids: ``(B, T)`` sampled response tokens (padding may hold any valid id).
        response_start: column where the response starts in the model's input (int or ``(B,)``); the logits at
            ``start - 1 + t`` predict token ``t``. ``None``: ``logits`` are already aligned, ``L == T``.
        mu_topk_ids: ``(B, T, K)`` mu's top-K ids per position (as logged by the engine), or None.
        chunk_tokens: tokens per chunk; memory beyond the logits is ``chunk_tokens x V`` float32.
        temperature: the sampler's temperature: the logits are divided by it before the log-softmax, as the
            sampler did, so pi and mu describe the same distribution. Must be finite and > 0.

    Returns:
        :class:`Capture` with ``logprob`` ``(B, T)``, ``entropy`` ``(B, T)``, ``topk_logprobs`` ``(B, T, K)``,
        all of ``softmax(logits / temperature)``.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, L, V), got shape {tuple(logits.shape)}")
    B, L, V = logits.shape
    if response_ids.ndim != 2 or response_ids.shape[0] != B:
        raise ValueError(f"response_ids must be (B, T) with B = {B}, got shape {tuple(response_ids.shape)}")
    T = response_ids.shape[1]
    if response_start is None:
        if L != T:
            raise ValueError(f"logits have L = {L} positions but response_ids T = {T}: pass response_start")
        rows = torch.arange(B * T, device=logits.device).reshape(B, T)
    else:
        rows = response_rows(logits.shape, response_start, T, logits.device)  # (B, T)
    ids = response_ids.long().unsqueeze(-1)  # (B, T, 1)
    if mu_topk_ids is not None:
        if mu_topk_ids.shape[:2] != (B, T) or mu_topk_ids.ndim != 3:
            raise ValueError(f"mu_topk_ids must be (B, T, K) = ({B}, {T}, K), got {tuple(mu_topk_ids.shape)}")
        ids = torch.cat([ids, mu_topk_ids.long()], dim=-1)  # (B, T, 1 + K)
    ids = ids.to(logits.device).clamp(0, V - 1)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    scale = _inverse_temperature(temperature)
    flat = logits.reshape(B * L, V)  # a view for contiguous logits
    lp, entropy = _GatherLogprobs.apply(flat, rows.reshape(-1), ids.reshape(B * T, -1), chunk_tokens, scale)
    lp = lp.reshape(B, T, -1)  # (B, T, 1 + K)
    topk = lp[..., 1:] if mu_topk_ids is not None else None
    return Capture(logprob=lp[..., 0], entropy=entropy.reshape(B, T), topk_logprobs=topk)


def top_k(
    logits: Tensor,
    k: int,
    *,
    T: int | None = None,
    response_start: int | Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely ids of ``softmax(logits / temperature)`` at each response position, with log-probs.

    A trainer-side stand-in for an engine's top-K when the engine reports none (no gradient; chunked over tokens
    like :func:`capture`). ``logits`` ``(B, L, V)``; ``T`` response positions starting at ``response_start`` (as in
    :func:`capture`; ``None``: the logits are aligned and ``T = L``). Returns ``ids`` ``(B, T, k)`` int64 and
    ``logprobs`` ``(B, T, k)`` float32, sorted by descending probability.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, L, V), got shape {tuple(logits.shape)}")
    B, L, V = logits.shape
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, V] = [1, {V}], got {k}")
    if response_start is None:
        if T is not None and T != L:
            raise ValueError(f"logits have L = {L} positions but T = {T}: pass response_start")
        T = L
        rows = torch.arange(B * L, device=logits.device)
    else:
        if T is None:
            raise ValueError("T (the number of response positions) is required with response_start")
        rows = response_rows(logits.shape, response_start, T, logits.device).reshape(-1)  # (B * T,)
    scale = _inverse_temperature(temperature)
    flat = logits.detach().reshape(B * L, V)
    ids = torch.empty(rows.shape[0], k, dtype=torch.long, device=logits.device)  # (N, k)
    lps = torch.empty(rows.shape[0], k, dtype=torch.float32, device=logits.device)  # (N, k)
    with torch.no_grad():
        for start in _chunks(rows.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            x = flat.index_select(0, rows[sl]).float().mul_(scale)  # (c, V)
            top = x.topk(k, dim=-1)
            ids[sl] = top.indices
            lps[sl] = top.values - torch.logsumexp(x, dim=-1, keepdim=True)
    return ids.reshape(B, T, k), lps.reshape(B, T, k)


def fused_head_forward(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside ``model`` whose forward TRL's ``add_fused_lm_head`` replaced, or None.

    That forward, called with ``fused_lm_head=True`` as TRL's trainers do, returns ``FusedCausalLMOutput``
    (log-probs and entropy of the labels, no logits). It is recognised by the keyword it adds to the forward.
    """
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            return module
    return None


_NO_LOGITS_HINT = (
    "Use trustscope.integrations.trl.attach(trainer, logdir) for TRL trainers (it reads the log-probs and entropy "
    "from the loss's own forward), or call trustscope.capture.capture() on logits you compute with a plain forward."
)


class CaptureHook:
    """Context manager that captures from every forward of ``model`` while it is open.

    ``model`` is any module whose output is a tensor of logits ``(B, L, V)``, a tuple starting with one, or an object
    with ``.logits`` (Hugging Face ``CausalLMOutput``). After the ``with`` block, ``result`` holds the
    :class:`Capture` of the last forward (``results`` of all of them). Captures are detached and computed under
    ``no_grad`` unless ``keep_grad=True``. ``temperature`` is the sampler's (see :func:`capture`).

    A model that returns no logits is refused with :class:`NoLogitsError` naming the alternative: when the hook is
    created, if TRL's fused LM head replaced the model's forward; otherwise at the first forward whose output
    holds no ``(B, L, V)`` tensor.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        response_ids: Tensor,
        *,
        response_start: int | Tensor | None = None,
        mu_topk_ids: Tensor | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        temperature: float = 1.0,
        keep_grad: bool = False,
    ):
        fused = fused_head_forward(model)
        if fused is not None:
            raise NoLogitsError(
                f"CaptureHook: the forward of {type(fused).__name__} was replaced by TRL's fused LM head "
                f"(trl.trainer.utils.add_fused_lm_head): in training it returns FusedCausalLMOutput, log-probs and "
                f"entropy without logits, so there is nothing to capture from. {_NO_LOGITS_HINT}")
        _inverse_temperature(temperature)
        self.model = model
        self.kwargs = {"response_start": response_start, "mu_topk_ids": mu_topk_ids, "chunk_tokens": chunk_tokens,
                       "temperature": temperature}
        self.response_ids = response_ids
        self.keep_grad = keep_grad
        self.results: list[Capture] = []
        self._handle: Any = None

    @property
    def result(self) -> Capture:
        if not self.results:
            raise RuntimeError("CaptureHook saw no forward pass of the model")
        return self.results[-1]

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list, Tensor)):
            logits = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(logits, Tensor) or logits.ndim != 3:
            raise NoLogitsError(
                f"CaptureHook: the output of {type(module).__name__} ({type(output).__name__}) holds no logits "
                f"of shape (B, L, V). {_NO_LOGITS_HINT}")
        if self.keep_grad:
            self.results.append(capture(logits, self.response_ids, **self.kwargs))
        else:
            with torch.no_grad():
                self.results.append(capture(logits.detach(), self.response_ids, **self.kwargs).detach())

    def __enter__(self) -> CaptureHook:
        self._handle = self.model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
