"""The engine's side of a TRL batch: vLLM's log-prob lists split into the sampled token's and the top-K, and the
engine call each turn of a multi-turn (tool) completion came from (:func:`engine_rows`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def split_engine_logprobs(
    completion_ids: list[list[int]], logprobs: list[list[list[float | None]]], logprob_ids: list[list[list[int]]],
    k: int,
) -> tuple[list[list[list[float | None]]], list[list[list[int]]], list[list[list[float]]]]:
    """vLLM's per-token log-prob lists (sorted by rank, as TRL returns them) -> what TRL reads, and mu's top-K.

    TRL 1.16 keeps ``lp[0]`` of each token's list as the sampled token's log-prob, which holds only when vLLM was
    asked for no top-K. This returns the lists reordered with the sampled token's entry first (``None`` when vLLM
    did not score it), and per sequence the first ``k`` ids and log-probs by rank (NaN where missing); shapes
    ``(B, T_i, ...)``, ragged like the input.
    """
    trl_view, topk_ids, topk_lps = [], [], []
    for seq, seq_lps, seq_ids in zip(completion_ids, logprobs, logprob_ids, strict=True):
        view, ids_rows, lps_rows = [], [], []
        for token, lps, ids in zip(seq, seq_lps, seq_ids, strict=True):
            j = ids.index(token) if token in ids else None
            view.append([None if j is None else lps[j]] + [lp for i, lp in enumerate(lps) if i != j])
            row_ids = list(ids[:k]) + [0] * (k - min(k, len(ids)))
            row_lps = [math.nan if lp is None else float(lp) for lp in lps[:k]] + [math.nan] * (k - min(k, len(lps)))
            ids_rows.append(row_ids)
            lps_rows.append(row_lps)
        trl_view.append(view)
        topk_ids.append(ids_rows)
        topk_lps.append(lps_rows)
    return trl_view, topk_ids, topk_lps


@dataclass
class EngineCall:
    """One ``vllm_generation.generate`` call of a rollout: its id prompts, the engine's completions and, with
    top-K, mu's top-K per completion token (ragged, as :func:`split_engine_logprobs` returns them)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    topk_ids: list[list[list[int]]] | None = None
    topk_lps: list[list[list[float]]] | None = None


def _segments(tool_mask: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of 1s (the model's turns) in a completion's tool mask."""
    out, start = [], None
    for t, m in enumerate([*tool_mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t - start))
            start = None
    return out


def engine_rows(calls: list[EngineCall], prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]],
                tool_masks: list[tuple[int, ...]] | None, k: int
                ) -> tuple[list[list[int]], tuple[list, list] | None]:
    """Per completion of a rollout, the id the engine returned at each position (-1 on a tool's result and where
    no call produced it) and, when every call has them, mu's top-K there (ids 0 and NaN log-probs elsewhere).

    TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) calls the engine once for the whole batch (row i:
    completion i) and then once per round for the completions still calling tools, each row's prompt the
    completion's prompt + its ids so far + the tool's result (concatenated ids), its output spliced in after the
    result, cut to ``max_completion_length``. So the model turn of completion i starting at position s came from the
    later call whose prompt is ``prompts[i] + completions[i][:s]``; of several such rows (two completions with the
    same history), the one whose output matches the completion's ids.
    """
    first, index = calls[0], {}
    for call in calls[1:]:
        for r, p in enumerate(call.prompts):
            index.setdefault(tuple(p), []).append((call, r))
    with_topk = all(c.topk_ids is not None for c in calls)
    ids_out, tk_ids_out, tk_lps_out = [], [], []
    for i, comp in enumerate(completions):
        comp = list(comp)
        n = len(comp)
        ids, tk_ids, tk_lps = [-1] * n, [[0] * k for _ in range(n)], [[math.nan] * k for _ in range(n)]
        for s, length in _segments(tool_masks[i] if tool_masks is not None else [1] * n):
            if s == 0 and i < len(first.prompts) and tuple(first.prompts[i]) == tuple(prompts[i]):
                found = (first, i)
            else:
                rows = index.get(tuple(prompts[i]) + tuple(comp[:s]), [])
                found = next((cr for cr in rows if list(cr[0].completions[cr[1]][:length]) == comp[s:s + length]),
                             rows[0] if rows else None)
            if found is None:
                continue
            call, r = found
            got = list(call.completions[r][:length])
            ids[s:s + len(got)] = got
            if with_topk:
                tk_ids[s:s + len(got)] = call.topk_ids[r][:len(got)]
                tk_lps[s:s + len(got)] = call.topk_lps[r][:len(got)]
        ids_out.append(ids)
        tk_ids_out.append(tk_ids)
        tk_lps_out.append(tk_lps)
    return ids_out, ((tk_ids_out, tk_lps_out) if with_topk else None)
