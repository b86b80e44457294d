"""The known causes of training-inference mismatch, one declaration each: what every part of ``trustscope explain``
(the allocation, the text and JSON, the doctor checks, the dashboard page, the report section) reads.

A cause is a per-token indicator of the table macro ``explain_tokens`` (``trustscope/sql/table_macros``), null
where the token lacks the columns it needs. Adding a cause is one :class:`Cause` here and its indicator column in
that macro (and ``explain_patterns`` groups by it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    """One known cause of mismatch.

    Attributes:
        source: its name in the output (JSON ``source``) and in the doctor check ``cause_<source>``.
        column: its indicator column in ``explain_tokens``.
        needs: the token columns the indicator reads beyond mu and pi; a run where none of its tokens has them
            gets "not measurable: needs `COLUMN`".
        title: a few words for tables and charts.
        fix: what to change when the cause carries the mismatch.
    """

    source: str
    column: str
    needs: tuple[str, ...]
    title: str
    fix: str


CAUSES: tuple[Cause, ...] = (
    Cause("temperature", "temperature", ("mu_topk_logprobs", "pi_topk_logprobs"), "temperature mismatch",
          "the engine returns log-probs at another temperature than the trainer divides by (vLLM's processed "
          "log-probs at T != 1 against a trainer at 1, or raw log-probs against a trainer dividing by T): divide the "
          "trainer's logits by the sampling temperature, or ask the engine for the log-probs the trainer computes"),
    Cause("truncation", "truncation", ("mu_topk_logprobs", "pi_topk_logprobs"), "top-k / top-p truncation",
          "the engine renormalises mu over its top-k / top-p support while pi covers the whole vocabulary: apply the "
          "engine's truncation mask to pi (DeepSeek-V3.2's keep-sampling mask), or log the engine's raw log-probs"),
    Cause("position_shift", "shift", (), "position shift",
          "mu and pi are logged one position apart in some responses (or from a turn on): slice both from the same "
          "offset (doctor checks alignment and turn_alignment say which way)"),
    Cause("token_drift", "drift", ("engine_token_id",), "token drift",
          "the ids the trainer scores are not the ids the engine sampled (a history decoded and re-tokenized): "
          "train on the engine's token ids instead of re-tokenizing the text"),
    Cause("staleness", "stale", ("policy_version",), "staleness",
          "tokens sampled by older weights carry the mismatch: lower the policy lag, or let the trust region see "
          "the lag (importance weights against the sampling policy)"),
    Cause("routing", "routing", ("routing_agreement",), "MoE routing disagreement",
          "the trainer's router picks other experts than the engine's: replay the engine's routing in the trainer "
          "(routing replay) or align the router's numerics"),
)
"""Every cause, in the order they are reported."""

UNEXPLAINED = "unexplained"
"""The remainder: mismatch on tokens no cause touches (numerics: kernels, dtypes, batch composition, and whatever
no detector sees), plus the baseline level every touched token carries too."""


def cause(source: str) -> Cause:
    """The cause named ``source``; KeyError names the known ones."""
    for c in CAUSES:
        if c.source == source:
            return c
    raise KeyError(f"no cause {source!r}; causes: {[c.source for c in CAUSES]}")
