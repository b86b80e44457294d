"""The sampler's truncation on the trainer's side: the keep-sampling mask.

An engine that samples with top-k or top-p draws from a support: the ``top_k`` likeliest tokens, then the smallest
set of those whose (renormalised) mass reaches ``top_p``; its processed log-probs (mu) are renormalised over that
support. The trainer's full softmax (pi) is not comparable with it. DeepSeek-V3.2's keep-sampling mask applies the
sampler's support to the trainer's logits, so pi is renormalised over the same tokens. :func:`keep_support` does
it from the trainer's own tempered logits (the engine does not return its support; the two differ only at the
support's edge), always keeping the sampled token.
"""

from __future__ import annotations

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.sampling")

MASKED = -1.0e9
"""The logit a token outside the support gets: ``exp`` of it is 0 in float32, and ``0 * MASKED`` stays 0 in the
entropy (``-inf`` would make it NaN)."""


@torch.no_grad()
def support(logits: torch.Tensor, sampled: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``(..., V)`` bool: the tokens the sampler could draw at each position (the ``top_k`` likeliest, then the
    nucleus of mass ``top_p`` of what is left, as vLLM and transformers apply them), the sampled token
    (``sampled``, ``(...)``) always in it."""
    z = logits.float()
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k > 0 and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        keep &= z >= kth
    if top_p < 1:
        probs = z.masked_fill(~keep, float("-inf")).softmax(-1)  # (..., V)
        ordered, order = probs.sort(-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the likelier tokens
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    return keep.scatter(-1, sampled.long()[..., None], True)


def keep_support(logits: torch.Tensor, sampled: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``logits`` with every token outside the sampler's :func:`support` set to :data:`MASKED`: the softmax is then
    renormalised over the support, and no gradient reaches the tokens outside it."""
    return logits.masked_fill(~support(logits, sampled, top_p, top_k), MASKED)
