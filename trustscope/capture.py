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
(:class:`NoLogitsError`), and names what to use instead. For such a model, pi at mu's top-K ids comes from the final
hidden states and the LM head's rows at those ids, with the log-normaliser recovered from the fused head's log-prob
of the sampled token (:func:`logprobs_from_hidden`, no ``(N, V)`` tensor; :func:`top_k_from_hidden` for pi's own
top-K)::

    pi_topk = logprobs_from_hidden(hidden, model.lm_head.weight, mu_topk_ids, label_ids=response_ids,
                                   label_logprobs=fused.log_probs, temperature=tau)
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


# ------------------------------------------------------------------------------------------ from hidden states

DEFAULT_CHUNK_VOCAB = 8192
"""Vocabulary rows per tile when the log-normaliser is computed: a tile is ``chunk_tokens x chunk_vocab``."""
_GATHER_ELEMENTS = 1 << 24
"""At most this many gathered head values ``(tokens, J, H)`` at once (32 MB in bf16)."""


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary-parallel LM head (Megatron's ``VocabParallelEmbedding`` layout).

    The rank's ``weight`` ``(V_s, H)`` holds the rows of ids ``[start, start + V_s)`` of a vocabulary of
    ``vocab_size`` ids (padded, if the framework pads it); every rank of ``group`` (a ``torch.distributed`` process
    group, None: the default one) holds the same hidden states and calls :func:`logprobs_from_hidden` together.
    """

    start: int
    vocab_size: int
    group: Any = None


@dataclass
class HeadPartial:
    """One shard's share of :func:`logprobs_from_hidden`, before the shards are combined.

    Attributes:
        logits: ``(N, J)`` float32 logits (scaled, soft-capped, divided by the temperature) at the ids this shard
            owns, 0 at the others: the shards' sum is the logits at every id.
        log_normaliser: ``(N,)`` float32 logsumexp of the shard's logits over its rows; None when the normaliser
            comes from the label's log-prob.
    """

    logits: Tensor
    log_normaliser: Tensor | None


def _transform(y: Tensor, logit_scale: float, softcap: float | None, inv_t: float) -> Tensor:
    """The head's raw output -> the sampler's logits: times ``logit_scale``, soft-capped, over the temperature."""
    if logit_scale != 1.0:
        y = y * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y * inv_t if inv_t != 1.0 else y


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (the gradient checks run in float64)."""
    return torch.promote_types(torch.float32, dtype)


def _tile(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``hidden @ weight.T + bias`` in ``dtype``, as the head's GEMM rounds it, then float32."""
    y = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(_math_dtype(dtype))


class _HeadGather(torch.autograd.Function):
    """The head's raw output at given rows, ``y[n, j] = hidden[n] . weight[ids[n, j]] + bias[ids[n, j]]``.

    forward(hidden (N, H), weight (V_s, H), bias (V_s,) or None, ids (N, J) local rows, dtype) -> y (N, J)
    float32, rounded to the matmul's ``dtype`` as the head's GEMM rounds it. Chunked over tokens so the gathered rows are never
    more than :data:`_GATHER_ELEMENTS`; saves only its inputs, by reference.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor,
                dtype: torch.dtype) -> Tensor:
        N, J = ids.shape
        step = max(1, _GATHER_ELEMENTS // max(1, J * hidden.shape[1]))
        out = torch.empty(N, J, dtype=_math_dtype(dtype), device=hidden.device)  # (N, J)
        for start in _chunks(N, step):
            sl = slice(start, start + step)
            rows = weight.index_select(0, ids[sl].reshape(-1)).reshape(-1, J, weight.shape[1])  # (c, J, H)
            y = torch.bmm(rows.to(dtype), hidden[sl].to(dtype).unsqueeze(-1)).squeeze(-1)  # (c, J) in dtype
            if bias is not None:
                y = y + bias.index_select(0, ids[sl].reshape(-1)).reshape(-1, J).to(dtype)
            out[sl] = y
        ctx.save_for_backward(hidden, weight, bias, ids)
        ctx.step = step
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, ids = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N, J = ids.shape
        H = hidden.shape[1]
        math_dtype = _math_dtype(grad.dtype)
        grad = grad.to(math_dtype)
        g_h = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=math_dtype, device=weight.device) if need_w else None
        g_b = torch.zeros(bias.shape, dtype=math_dtype, device=bias.device) if need_b else None
        for start in _chunks(N, ctx.step):
            sl = slice(start, start + ctx.step)
            flat = ids[sl].reshape(-1)  # (c * J,)
            if g_h is not None:
                rows = weight.index_select(0, flat).reshape(-1, J, H).to(math_dtype)  # (c, J, H)
                g_h[sl] = torch.bmm(grad[sl].unsqueeze(1), rows).squeeze(1)
            if g_w is not None:
                g_w.index_add_(0, flat, (grad[sl, :, None] * hidden[sl, None, :].to(math_dtype)).reshape(-1, H))
            if g_b is not None:
                g_b.index_add_(0, flat, grad[sl].reshape(-1))
        return (None if g_h is None else g_h.to(hidden.dtype), None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(bias.dtype), None, None)


class _HeadLogNormaliser(torch.autograd.Function):
    """logsumexp over the head's rows of the sampler's logits, tile by tile: no ``(N, V)`` tensor.

    forward(hidden (N, H), weight (V_s, H), bias, logit_scale, softcap, inv_t, chunk_tokens, chunk_vocab, dtype)
    -> (N,) float32, the tiles' matmuls in ``dtype``. Saves its inputs by reference and the result; backward recomputes each tile.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, logit_scale: float,
                softcap: float | None, inv_t: float, chunk_tokens: int, chunk_vocab: int,
                dtype: torch.dtype) -> Tensor:
        N, V = hidden.shape[0], weight.shape[0]
        lse = torch.full((N,), -math.inf, dtype=_math_dtype(dtype), device=hidden.device)  # (N,)
        for t0 in _chunks(N, chunk_tokens):
            ts = slice(t0, t0 + chunk_tokens)
            acc = lse[ts]
            for v0 in _chunks(V, chunk_vocab):
                vs = slice(v0, v0 + chunk_vocab)
                z = _transform(_tile(hidden[ts], weight[vs], None if bias is None else bias[vs], dtype),
                               logit_scale, softcap, inv_t)  # (c, v)
                acc = torch.logaddexp(acc, torch.logsumexp(z, dim=-1))
            lse[ts] = acc
        ctx.save_for_backward(hidden, weight, bias, lse)
        ctx.settings = (logit_scale, softcap, inv_t, chunk_tokens, chunk_vocab, dtype)
        return lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, lse = ctx.saved_tensors
        logit_scale, softcap, inv_t, chunk_tokens, chunk_vocab, dtype = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N, V = hidden.shape[0], weight.shape[0]
        math_dtype = _math_dtype(grad.dtype)
        grad = grad.to(math_dtype)
        g_h = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=math_dtype, device=weight.device) if need_w else None
        g_b = torch.zeros(bias.shape, dtype=math_dtype, device=bias.device) if need_b else None
        for t0 in _chunks(N, chunk_tokens):
            ts = slice(t0, t0 + chunk_tokens)
            h = hidden[ts]
            for v0 in _chunks(V, chunk_vocab):
                vs = slice(v0, v0 + chunk_vocab)
                y = _tile(h, weight[vs], None if bias is None else bias[vs], dtype)  # (c, v)
                # d lse / d z = softmax(z); d z / d y = logit_scale * inv_t * (1 - tanh^2) with the soft cap
                scale = logit_scale * inv_t
                if softcap is not None:
                    cap = torch.tanh(y * (logit_scale / softcap))
                    g = (softcap * inv_t * cap).sub_(lse[ts, None]).exp_().mul_(grad[ts, None] * scale)
                    g.mul_(1 - cap * cap)
                else:
                    g = y.mul_(scale).sub_(lse[ts, None]).exp_().mul_(grad[ts, None] * scale)  # (c, v)
                if g_h is not None:
                    g_h[ts] += g @ weight[vs].to(math_dtype)
                if g_w is not None:
                    g_w[vs] += g.t() @ h.to(math_dtype)
                if g_b is not None:
                    g_b[vs] += g.sum(0)
        return (None if g_h is None else g_h.to(hidden.dtype), None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(bias.dtype), None, None, None, None, None, None)


def _first_bad(name: str, bad: Tensor, values: Tensor, what: str) -> None:
    """Raise naming the first index where ``bad`` holds, with its value."""
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0].tolist())
        value = values[index].item()
        raise ValueError(f"{name} of shape {tuple(values.shape)}: index {index} = {value!r} {what}")


def head_partial(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    bias: Tensor | None = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    log_normaliser: bool = True,
    matmul_dtype: torch.dtype | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
) -> HeadPartial:
    """One vocabulary shard's share of :func:`logprobs_from_hidden` (no checks; that function makes them).

    ``hidden`` ``(N, H)``, ``weight`` ``(V_s, H)`` (the rows of ids ``[vocab_start, vocab_start + V_s)``),
    ``ids`` ``(N, J)`` global ids. :func:`combine_head_partials` turns the shards' partials into log-probs; a
    single head is one shard with ``vocab_start=0``.
    """
    inv_t = _inverse_temperature(temperature)
    dtype = matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    local = ids.long() - vocab_start  # (N, J)
    owned = (local >= 0) & (local < weight.shape[0])  # (N, J)
    y = _HeadGather.apply(hidden, weight, bias, local.clamp(0, weight.shape[0] - 1), dtype)  # (N, J)
    logits = _transform(y, logit_scale, softcap, inv_t) * owned  # (N, J)
    lse = (_HeadLogNormaliser.apply(hidden, weight, bias, logit_scale, softcap, inv_t, chunk_tokens, chunk_vocab,
                                    dtype) if log_normaliser else None)
    return HeadPartial(logits=logits, log_normaliser=lse)


def combine_head_partials(parts: list[HeadPartial], label_logprobs: Tensor | None = None) -> Tensor:
    """log pi at the ids of :func:`head_partial` from every shard's partial: ``(N, J)`` float32, or ``(N, J - 1)``
    with ``label_logprobs`` ``(N,)``, where the first id of each row is the label and its log-prob gives the
    log-normaliser (``log Z = z_label - log pi(label)``)."""
    logits = parts[0].logits if len(parts) == 1 else torch.stack([p.logits for p in parts]).sum(0)  # (N, J)
    if label_logprobs is not None:
        log_z = logits[:, 0] - label_logprobs.to(logits.dtype)  # (N,)
        return logits[:, 1:] - log_z[:, None]
    if any(p.log_normaliser is None for p in parts):
        raise ValueError("combine_head_partials: a partial has no log_normaliser and no label_logprobs were given")
    lse = parts[0].log_normaliser if len(parts) == 1 else torch.logsumexp(
        torch.stack([p.log_normaliser for p in parts]), dim=0)  # (N,)
    return logits - lse[:, None]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of a tensor-parallel group; the gradient passes through unchanged (every rank holds the
    same result and computes the same loss from it, as Megatron's reduction into the tensor-parallel region)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _reduce_shards(part: HeadPartial, group: Any) -> HeadPartial:
    """Every rank's partial of a vocabulary-parallel head, combined into one (on every rank)."""
    import torch.distributed as dist

    logits = _AllReduceSum.apply(part.logits, group)
    lse = part.log_normaliser
    if lse is not None:
        top = lse.detach().clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a shift, for a stable sum of exponentials
        lse = top + torch.log(_AllReduceSum.apply(torch.exp(lse - top), group))
    return HeadPartial(logits=logits, log_normaliser=lse)


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    bias: Tensor | None = None,
    label_ids: Tensor | None = None,
    label_logprobs: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    shard: VocabShard | None = None,
    matmul_dtype: torch.dtype | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
) -> Tensor:
    """pi's log-probs at given ids from the final hidden states and the LM head, without the logits.

    ``log pi(k) = z_k - log Z`` with ``z = transform(hidden @ weight.T + bias)`` (``transform``: times
    ``logit_scale``, soft-capped at ``softcap`` as Gemma's ``final_logit_softcapping``, over ``temperature``) and
    ``log Z = logsumexp(z)``. ``z_k`` needs only the head's rows at the ids: ``O(N K H)``. ``log Z`` is

    - recovered from the label's log-prob where a fused head returns it (TRL's ``FusedCausalLMOutput.log_probs``,
      computed at the same temperature): ``log Z = z_label - log pi(label)``, no pass over the vocabulary;
    - else computed tile by tile over the vocabulary (``chunk_tokens x chunk_vocab`` at a time; the logsumexp is
      accumulated tile by tile, so no ``(N, V)`` tensor is made, in the forward or the backward).

    The logits are rounded to the matmul's dtype (``matmul_dtype``; None: ``promote_types(hidden.dtype,
    weight.dtype)``; under autocast pass the autocast dtype) as the head's GEMM rounds them, then the math is float32: in bf16 the result equals the full-logits log-softmax of the bf16
    logits up to the GEMM's own rounding. Gradients flow to ``hidden``, ``weight``, ``bias`` and
    ``label_logprobs`` where they require them; the backward recomputes what it needs tile by tile.

    Args:
        hidden: ``(*, H)`` final hidden states (after the final norm: the LM head's input), one per position.
        weight: ``(V, H)`` the LM head's weight (the embedding for a tied head), or this rank's rows with ``shard``.
        ids: ``(*, K)`` ids to score at each position (mu's top-K), in ``[0, V)``.
        bias: ``(V,)`` the head's bias (this rank's slice with ``shard``), or None.
        label_ids: ``(*,)`` the label at each position (the token the fused head scored); with ``label_logprobs``.
        label_logprobs: ``(*,)`` log pi(label) at the same temperature, finite; gives log Z.
        temperature: the sampler's (see :func:`capture`).
        logit_scale: the model's own multiplier of its logits (1 for most models; TRL reads it from the config).
        softcap: the model's soft cap of its logits (Gemma's ``final_logit_softcapping``; None for most models).
        shard: the vocabulary slice ``weight`` holds on this rank of a tensor-parallel group (every rank of the
            group calls this with the same ``hidden``, ``ids`` and labels); None: ``weight`` is the whole head.
        matmul_dtype: the dtype the head's matmul runs in (only the gathered rows are cast to it).
        chunk_tokens: tokens per tile of the vocabulary pass, when there is one.
        chunk_vocab: vocabulary rows per tile of that pass.

    Returns:
        ``(*, K)`` float32 log pi at ``ids``.

    Raises:
        ValueError: naming the tensor and its shape, or the first bad index and its value: ``hidden``'s width not
            the head's, ``ids`` or ``label_ids`` outside the vocabulary, ``label_logprobs`` not finite, shapes that
            disagree.
    """
    if hidden.ndim < 1 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden of shape {tuple(hidden.shape)} (*, H) does not match the LM head's weight of shape "
                         f"{tuple(weight.shape)} (V, H): H = {hidden.shape[-1] if hidden.ndim else None} against "
                         f"{weight.shape[-1] if weight.ndim else None}")
    lead = tuple(hidden.shape[:-1])
    if ids.ndim != len(lead) + 1 or tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"ids of shape {tuple(ids.shape)} must be (*, K) with * = {lead}, hidden's leading shape")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids of shape {tuple(ids.shape)} must hold integer token ids, got dtype {ids.dtype}")
    V = weight.shape[0] if shard is None else int(shard.vocab_size)
    start = 0 if shard is None else int(shard.start)
    if shard is not None and not 0 <= start <= start + weight.shape[0] <= V:
        raise ValueError(f"shard rows [{start}, {start + weight.shape[0]}) (weight of shape {tuple(weight.shape)}) "
                         f"are not inside the vocabulary [0, {V})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} must be ({weight.shape[0]},), one per head row")
    _first_bad("ids", (ids < 0) | (ids >= V), ids, f"is outside the vocabulary [0, {V})")
    if (label_ids is None) != (label_logprobs is None):
        raise ValueError("label_ids and label_logprobs go together: pass both (log Z from the label) or neither "
                         "(log Z computed over the vocabulary)")
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk_tokens and chunk_vocab must be >= 1, got {chunk_tokens} and {chunk_vocab}")
    K = ids.shape[-1]
    flat_ids = ids.reshape(-1, K).long()  # (N, K)
    if label_ids is not None:
        for name, t in (("label_ids", label_ids), ("label_logprobs", label_logprobs)):
            if tuple(t.shape) != lead:
                raise ValueError(f"{name} of shape {tuple(t.shape)} must have hidden's leading shape {lead}")
        _first_bad("label_ids", (label_ids < 0) | (label_ids >= V), label_ids, f"is outside the vocabulary [0, {V})")
        _first_bad("label_logprobs", ~torch.isfinite(label_logprobs), label_logprobs,
                   "is not finite (log Z cannot be recovered from it)")
        flat_ids = torch.cat([label_ids.reshape(-1, 1).long(), flat_ids], dim=1)  # (N, 1 + K)
    part = head_partial(hidden.reshape(-1, hidden.shape[-1]), weight, flat_ids.to(weight.device), bias=bias,
                        vocab_start=start, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                        log_normaliser=label_ids is None, matmul_dtype=matmul_dtype, chunk_tokens=chunk_tokens,
                        chunk_vocab=chunk_vocab)
    if shard is not None:
        part = _reduce_shards(part, shard.group)
    labels = None if label_logprobs is None else label_logprobs.reshape(-1).to(part.logits.device)
    return combine_head_partials([part], labels).reshape(*lead, K)


@torch.no_grad()
def top_k_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    bias: Tensor | None = None,
    label_ids: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The ``k`` most likely ids of pi at each position, from the final hidden states, tile by tile (no gradient).

    :func:`top_k` for a model whose logits are never built: ``hidden`` ``(*, H)``, the whole head ``weight``
    ``(V, H)`` (and ``bias``), the transform and dtype of :func:`logprobs_from_hidden`. One pass over the
    vocabulary in ``chunk_tokens x chunk_vocab`` tiles keeps a running top-``k`` and logsumexp per position.

    Returns:
        ``ids`` ``(*, k)`` int64 and ``logprobs`` ``(*, k)`` float32, by descending probability, and, when
        ``label_ids`` ``(*,)`` are given, log pi of each label ``(*,)`` (else None).
    """
    if hidden.ndim < 1 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden of shape {tuple(hidden.shape)} (*, H) does not match the LM head's weight of shape "
                         f"{tuple(weight.shape)} (V, H)")
    V = weight.shape[0]
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, V] = [1, {V}], got {k}")
    lead = tuple(hidden.shape[:-1])
    if label_ids is not None:
        if tuple(label_ids.shape) != lead:
            raise ValueError(f"label_ids of shape {tuple(label_ids.shape)} must have hidden's leading shape {lead}")
        _first_bad("label_ids", (label_ids < 0) | (label_ids >= V), label_ids, f"is outside the vocabulary [0, {V})")
    inv_t = _inverse_temperature(temperature)
    dtype = matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    N = flat.shape[0]
    ids = torch.empty(N, k, dtype=torch.long, device=flat.device)  # (N, k)
    values = torch.empty(N, k, dtype=torch.float32, device=flat.device)  # (N, k)
    lse = torch.empty(N, dtype=torch.float32, device=flat.device)  # (N,)
    for t0 in _chunks(N, chunk_tokens):
        ts = slice(t0, t0 + chunk_tokens)
        best_v = torch.full((flat[ts].shape[0], 0), -math.inf, device=flat.device)  # (c, <= k)
        best_i = torch.empty(best_v.shape, dtype=torch.long, device=flat.device)
        acc = torch.full((best_v.shape[0],), -math.inf, device=flat.device)  # (c,)
        for v0 in _chunks(V, chunk_vocab):
            vs = slice(v0, v0 + chunk_vocab)
            z = _transform(_tile(flat[ts], weight[vs], None if bias is None else bias[vs], dtype),
                           logit_scale, softcap, inv_t).float()  # (c, v)
            acc = torch.logaddexp(acc, torch.logsumexp(z, dim=-1))
            top = z.topk(min(k, z.shape[1]), dim=-1)
            cand_v = torch.cat([best_v, top.values], dim=1)
            cand_i = torch.cat([best_i, top.indices + v0], dim=1)
            keep = cand_v.topk(min(k, cand_v.shape[1]), dim=-1)
            best_v, best_i = keep.values, cand_i.gather(1, keep.indices)
        ids[ts], values[ts], lse[ts] = best_i, best_v, acc
    label_lp = None
    if label_ids is not None:
        y = _HeadGather.apply(flat, weight, bias, label_ids.reshape(-1, 1).long().to(flat.device), dtype)  # (N, 1)
        label_lp = (_transform(y[:, 0], logit_scale, softcap, inv_t).float() - lse).reshape(lead)
    return ids.reshape(*lead, k), (values - lse[:, None]).reshape(*lead, k), label_lp


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
