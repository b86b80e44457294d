"""Exact per-step summaries over every token of a ``log_step`` call, taken before the ``token_fraction`` sample.

``token_fraction`` keeps the token rows of a sample of sequences; these aggregates are taken over all of them (bad
rows dropped with ``strict=False`` excepted), so the ``summaries`` table reads the same at any fraction. The call
checks and copies the rows; the writer thread computes the summaries over all of them and only then applies the
sample (:meth:`trustscope.logger.batch.Batch.apply_sample`), so ``log_step`` itself stays short. Every
figure is mergeable (a count, a sum, a sum of squares, a min, a max, a histogram bin's count): the ``summaries``
view adds up the micro-batches of a step and the ranks of a run.

Rows (:data:`trustscope.runformat.layout.SUMMARIES`), ``metric`` being one of:

- ``tokens``: token count per advantage sign (positive, negative, zero) and mu bucket.
- ``blocked``: per registered rule (:func:`trustscope.losses.list_losses`: the rule the run trains with at its
  own parameters, every other at its defaults), the tokens its keep-mask blocks, per advantage sign (positive,
  negative: A = 0 is left out, a blocked A = 0 token carries no gradient either way) and mu bucket: every rule's
  mask from :func:`trustscope.losses.keep_masks`, without its loss, the rules sharing their ratios and
  divergences. The top-K rules gate on the stored ``topk_tv`` / ``topk_kl``, as the SQL views do. A rule that
  needs a column the call lacks (top-K, old_logprob) has no rows. Each rule setting the logger was given
  (``TokenLogger(rule_settings=...)``, :mod:`trustscope.rule_settings`) has rows of its own, ``rule`` being the
  setting's name (``geo_mask@0.99``, ``ppo_clip:eps_low=0.1,eps_high=0.1``), whose parameters the name gives back
  and ``run.json``'s ``logging.summary_rules`` records.
- ``threshold_hist``: per rule with a scalar threshold (:class:`trustscope.losses.Threshold`), at the parameters
  of its ``blocked`` rows, the tokens with A != 0 by the scale at which the rule starts to block them (its
  ``score``), binned on :data:`THRESHOLD_EDGES`: the rule at scale u blocks the tokens of every bin above u, so the
  blocked count at any bin edge, and the threshold that blocks a given share to within one bin, follow exactly
  (``LogDB.equal_budget``). Tokens no scale blocks are not counted; those every scale blocks are in the last bin.
- ``trainer_blocked``: tokens with ``kept`` False, per advantage sign and mu bucket.
- ``bad_negative``: tokens with A < 0 and mu - pi >= ``threshold`` (minimal_negative_mask's default delta, the
  SQL's ``bad_negative_delta``).
- ``prob_diff`` (pi - mu, signed), ``abs_prob_diff`` (|pi - mu|), ``topk_tv``, ``topk_kl``, ``entropy``,
  ``routing_agreement`` (MoE runs): count, sum, sum of squares, min and max; ``routing_agreement`` once more per
  MoE layer when both routings are given, and the replace rate ``routing_replaced``, the fault counts
  ``routing_fallback`` / ``routing_shifted`` / ``routing_reused`` and |log pi/mu| by routing agreement
  (:func:`routing_rows`);
- ``<name>_hist`` for ``abs_prob_diff``, ``topk_tv``, ``topk_kl``, ``abs_seq_log_ratio``: the count per fixed bin
  ``[bin_low, bin_high)`` of :data:`HIST_EDGES`, so quantiles follow exactly to bin resolution (8 bins a decade).
- The early-warning signals (:func:`ratio_rows`), count, sum, sum of squares, min and max like the moments above:
  ``is_weight``, the importance weight w = pi / mu of every token (the step's effective sample size is
  ``sum^2 / sum_sq``, which merges exactly from the two sums); ``log_ratio``, log(pi / mu) per token;
  ``seq_log_ratio``, the mean log-ratio of each response (``count`` is responses), ``seq_is_weight``, its
  exponential (the response's geometric-mean weight, whose ESS is the response-level one), and
  ``abs_seq_log_ratio`` with its histogram, for the tails. A response is one call's rows of its ``sample_id``: the
  trainer hands each response whole to one call, so the per-response figures are exact.

Every metric above but the per-response ones (``seq_*``) is held once more per bucket of each summary dimension
(:data:`trustscope.columns.DIMENSIONS`: position bucket, turn, staleness = step - policy_version), each on its own
and never crossed with the mu bucket: rows with ``dimension`` and ``bucket`` set (:func:`dimension_rows`). A call
without a dimension's columns (no ``turn``, no ``policy_version``) has no rows of it.

The mu buckets are those of the SQL macro ``mu_bucket`` (``sql/macros/mu_bucket.sql``), whose edges are read from
that file: one definition. A bucket is stored as its lower edge (``mu_low``), which the view labels with the macro.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from trustscope.divergence_np import topk_divergences_np

MU_BUCKET_SQL = Path(__file__).resolve().parents[1] / "sql" / "macros" / "mu_bucket.sql"


def _mu_bucket_edges() -> np.ndarray:
    """The probability edges of the SQL macro ``mu_bucket`` (``when p < X``), in order."""
    edges = [float(x) for x in re.findall(r"when\s+p\s*<\s*([0-9.eE+-]+)", MU_BUCKET_SQL.read_text())]
    if not edges or edges != sorted(edges):
        raise RuntimeError(f"{MU_BUCKET_SQL}: expected increasing 'when p < X' edges, found {edges}")
    return np.array(edges)


MU_BUCKET_EDGES = _mu_bucket_edges()
"""``(5,)`` upper edges of the mu buckets but the last: bucket i holds ``MU_LOWS[i] <= mu_prob < edge i``."""
MU_LOWS = np.concatenate([[0.0], MU_BUCKET_EDGES])
"""``(6,)`` lower edge of each mu bucket."""
SIGNS = ("positive", "negative", "zero")

HIST_EDGES = np.concatenate([[0.0], 10.0 ** (np.arange(-56, 25) / 8.0), [np.inf]])
"""``(83,)`` histogram edges: 0, then 1e-7 to 1e3 at 8 per decade, then inf. Bin i is ``[edge i, edge i+1)``."""
THRESHOLD_EDGES = np.concatenate([[0.0], 10.0 ** (np.arange(-48, 49) / 8.0), [np.inf]])
"""``(99,)`` the ``threshold_hist`` edges, in scale (1: the parameters evaluated): 0, then 1e-6 to 1e6 at 8 per
decade, then inf (a default off by three decades, GSPO's on a model far from its own, still falls inside)."""


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread, then restore the caller's setting.

    Measured on this 2-core machine under load: 65k tokens x 13 rule masks took 0.25 CPU s on one thread and
    3.6-6.4 s with two, and a 512-token call's top-K divergences 8 ms per logsumexp (``docs/performance.md``).
    """
    import torch

    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _moments(name: str, x: np.ndarray) -> dict:
    # the sum of squares as an elementwise product: np.dot would call the multi-threaded BLAS, whose idle threads
    # spin for a while after each call (measured: +80% CPU over the whole summaries, docs/performance.md)
    x = np.asarray(x, dtype=np.float64)
    return {"metric": name, "count": len(x), "sum": float(x.sum()), "sum_sq": float(np.square(x).sum()),
            "min": float(x.min()), "max": float(x.max())}


def _hist(name: str, x: np.ndarray, edges: np.ndarray = HIST_EDGES) -> list[dict]:
    counts = np.bincount(np.searchsorted(edges, x, side="right") - 1, minlength=len(edges) - 1)
    return [{"metric": f"{name}_hist", "bin_low": float(edges[i]), "bin_high": float(edges[i + 1]),
             "count": int(counts[i])} for i in np.flatnonzero(counts)]


def _grouped(metric: str, group: np.ndarray, where: np.ndarray | None, signs: int, **extra: object) -> list[dict]:
    """Counts of ``group`` (sign * 6 + bucket) over the rows ``where``, one row per non-empty group."""
    counts = np.bincount(group if where is None else group[where], minlength=len(SIGNS) * len(MU_LOWS))
    return [{"metric": metric, "advantage_sign": SIGNS[g // len(MU_LOWS)], "mu_low": float(MU_LOWS[g % len(MU_LOWS)]),
             "count": int(counts[g]), **extra}
            for g in np.flatnonzero(counts[: signs * len(MU_LOWS)])]


def ratio_rows(mu_logprob: np.ndarray, pi_logprob: np.ndarray, seq: np.ndarray) -> list[dict]:
    """The importance-weight rows of one call (see the module docstring): ``mu_logprob``, ``pi_logprob`` ``(N,)``,
    ``seq`` ``(N,)`` the response of each token as an index ``0..B-1``, every index present. In float64."""
    log_ratio = pi_logprob.astype(np.float64) - mu_logprob.astype(np.float64)  # (N,)
    seq_mean = np.bincount(seq, weights=log_ratio) / np.bincount(seq)  # (B,)
    return [_moments("is_weight", np.exp(log_ratio)), _moments("log_ratio", log_ratio),
            _moments("seq_log_ratio", seq_mean), _moments("seq_is_weight", np.exp(seq_mean)),
            _moments("abs_seq_log_ratio", np.abs(seq_mean)), *_hist("abs_seq_log_ratio", np.abs(seq_mean))]


def blocked_rule_list() -> list[tuple[str, dict]]:
    """The rules a logger records in ``blocked_rules``, bit i for entry i: every registered rule with a SQL mask
    family (the ones the views show), sorted by name, at its default parameters, as many as fit
    (:data:`trustscope.runformat.layout.MAX_BLOCKED_RULES`). Fixed when the logger starts: the footer of each tokens file
    says which list its bits follow."""
    from trustscope import runformat as S
    from trustscope.losses import get_loss, list_losses

    rules = [get_loss(name) for name in sorted(list_losses()) if get_loss(name).sql is not None]
    return [(rule.name, dict(rule.defaults)) for rule in rules[: S.MAX_BLOCKED_RULES]]


SummaryRule = tuple[str, str, dict]
"""``(name, rule, params)``: what one set of ``blocked`` rows is (see :func:`summary_rules`)."""


def summary_rules(loss_rule: str | None = None, loss_params: dict | None = None,
                  settings: tuple = ()) -> tuple[SummaryRule, ...]:
    """The rule settings the summaries count blocks for: every registered rule under its own name, at its defaults
    except ``loss_rule`` (the rule the run trains with) at ``loss_params`` (its defaults where they are None or
    rejected), then each of ``settings`` (:class:`trustscope.rule_settings.RuleSetting`) under its name."""
    from trustscope.losses import get_loss, list_losses

    out = []
    for name in list_losses():
        params = dict(get_loss(name).defaults)
        if name == loss_rule and loss_params:
            with contextlib.suppress(TypeError, ValueError):
                params = get_loss(name).resolve(**loss_params)
        out.append((name, name, params))
    out += [(s.name, s.rule, dict(s.params)) for s in settings]
    return tuple(out)


def summarize_call(cols: dict[str, np.ndarray], bit_rules: tuple[str, ...] = (), step: int | None = None,
                   rules: tuple[SummaryRule, ...] | None = None) -> list[dict]:
    """:func:`summarize` over one call's rows, adding ``topk_tv``/``topk_kl`` to ``cols`` first when the top-K
    lists are there and the divergences are not (computed once, for every row, and written with the rows), and
    ``blocked_rules`` when ``bit_rules`` names rules (see :func:`summarize`)."""
    if "mu_topk_logprobs" in cols and "pi_topk_logprobs" in cols and not {"topk_tv", "topk_kl"} <= set(cols):
        tv, kl = topk_divergences_np(cols["mu_topk_logprobs"], cols["pi_topk_logprobs"])
        cols.setdefault("topk_tv", tv)
        cols.setdefault("topk_kl", kl)
    return summarize(cols, bit_rules, step, rules)


def _score_hist(name: str, score: np.ndarray) -> list[dict]:
    """``threshold_hist`` rows of one rule: the scores > 0 (NaN: blocked at no scale) on :data:`HIST_EDGES`."""
    score = score[score > 0]
    if not len(score):
        return []
    score = np.minimum(score, np.finfo(np.float64).max)  # blocked at every scale: the last bin, [1e6, inf)
    return [{**row, "metric": "threshold_hist", "rule": name} for row in _hist("threshold", score, THRESHOLD_EDGES)]


def summarize(cols: dict[str, np.ndarray], bit_rules: tuple[str, ...] = (), step: int | None = None,
              rules: tuple[SummaryRule, ...] | None = None) -> list[dict]:
    """The summary rows of one call's flat, checked token columns ``(N,)`` / ``(N, K)`` (every token).

    The rules' masks run on one torch intra-op thread (:func:`one_torch_thread`). With ``bit_rules``, the same
    masks also go into ``cols["blocked_rules"]`` ``(N,)`` int64: bit i set when ``bit_rules[i]`` blocks the row
    (a rule whose inputs the call lacks blocks nothing, as in the SQL views). The kept aggregates' first pass
    reads these bits instead of evaluating each rule again (:func:`trustscope.db.stored_rule_bits`). ``rules``:
    the settings counted (:func:`summary_rules`; default: every rule at its defaults); the bits are taken from
    the settings named like their rule, and only where those are at the rule's defaults.

    ``step``: the call's step, which the ``staleness`` dimension reads (None: no staleness rows).

    Returns dicts with ``metric`` and the other columns of :data:`trustscope.runformat.layout.SUMMARIES` that apply.
    """
    import torch

    from trustscope.losses import MaskTerms, PolicyBatch, get_loss, keep_masks, rules_with_inputs

    n = len(cols["mu_logprob"])
    if n == 0:
        return []
    mu_prob = np.exp(cols["mu_logprob"].astype(np.float64))  # (N,)
    pi_prob = np.exp(cols["pi_logprob"].astype(np.float64))  # (N,)
    adv = cols["advantage"]
    sign = np.where(adv > 0, 0, np.where(adv < 0, 1, 2))  # (N,) index into SIGNS
    group = sign * len(MU_LOWS) + np.searchsorted(MU_BUCKET_EDGES, mu_prob, side="right")  # (N,)
    rows = _grouped("tokens", group, None, 3)
    if "kept" in cols:
        rows += _grouped("trainer_blocked", group, ~cols["kept"], 3)

    # The rules see the call's padded (B, T) batch, rebuilt from (sample_id, pos): the sequence-level rules
    # (GSPO, geometric-mean masking, CPPO's prefix budget) need each response as one row, as the trainer had it.
    seq_ids, row = np.unique(cols["sample_id"], return_inverse=True)  # row: (N,) index into B
    pos = cols["pos"]
    shape = (len(seq_ids), int(pos.max()) + 1)  # (B, T)
    flat = row * shape[1] + pos  # (N,) index into the (B, T) grid
    dense = n == shape[0] * shape[1] and bool((np.diff(flat) == 1).all())  # every cell, in order: reshape only
    valid = np.ones(shape, dtype=bool) if dense else np.zeros(shape, dtype=bool)
    valid.reshape(-1)[flat] = True

    def tensor(name: str) -> torch.Tensor | None:
        if name not in cols:
            return None
        dtype = np.float64 if cols[name].dtype.kind == "f" else cols[name].dtype  # as the SQL computes
        if dense:
            return torch.from_numpy(np.array(cols[name], dtype=dtype).reshape(shape + cols[name].shape[1:]))
        padded = np.zeros(shape + cols[name].shape[1:], dtype=dtype)  # (B, T) / (B, T, K)
        padded[row, pos] = cols[name]
        return torch.from_numpy(padded)

    # The top-K rules gate on the stored topk_tv / topk_kl, as the SQL views do, so the (N, K) lists are not read.
    stored = {name: tensor(name) for name in MaskTerms.GIVEN if name in cols}
    given = stored if len(stored) == len(MaskTerms.GIVEN) else None
    lists = {} if given else {name: tensor(name) for name in ("mu_topk_logprobs", "pi_topk_logprobs")}
    batch = PolicyBatch(pi_logprob=tensor("pi_logprob"), mu_logprob=tensor("mu_logprob"),
                        advantages=tensor("advantage"), mask=torch.from_numpy(valid),
                        old_logprob=tensor("old_logprob"), **lists)
    signed = sign < 2
    rules = summary_rules() if rules is None else rules
    with_inputs = set(rules_with_inputs(batch, given))
    bit_of = {name: i for i, name in enumerate(bit_rules)}
    bits = np.zeros(n, dtype=np.int64) if bit_rules else None  # (N,)

    def flat_of(values: torch.Tensor) -> np.ndarray:
        values = values.numpy().reshape(-1)  # (B * T,)
        return values if dense else values[flat]  # (N,)

    with one_torch_thread(), torch.no_grad():
        base = {rule: params for name, rule, params in rules if name == rule and rule in with_inputs}
        masks = dict(keep_masks(batch, list(base), params=base, given=given))
        terms = MaskTerms(batch, given)  # the settings' masks and the scores share one set of terms
        for name, rule, params in rules:
            if name != rule and rule in with_inputs:
                spec = get_loss(rule)
                masks[name] = (spec.mask(terms, **{p: params[p] for p in spec.mask_params}) & terms.valid
                               if spec.mask is not None else
                               keep_masks(batch, [rule], params={rule: params}, given=given)[rule])
        scores = {rule: get_loss(rule).threshold.score(terms, **params) for rule, params in base.items()
                  if get_loss(rule).threshold is not None
                  and get_loss(rule).threshold.scalable(params) is None}  # (B, T) each
        for rule, score in scores.items():
            rows += _score_hist(rule, flat_of(score)[signed])
        # the bits follow the rules' defaults (the tokens files' footer says so)
        bit_masks = {name: masks[name] if base[name] == get_loss(name).defaults
                     else keep_masks(batch, [name], given=given)[name] for name in bit_of if name in base}
    blocked_by: dict[str, np.ndarray] = {}  # rule setting -> (N,) blocked A != 0 tokens, for the dimension rows
    for name, keep in masks.items():  # inputs checked finite already
        blocked_by[name] = ~flat_of(keep) & signed
        rows += _grouped("blocked", group, blocked_by[name], 2, rule=name)
    for name, keep in bit_masks.items():
        bits |= (~flat_of(keep)).astype(np.int64) << bit_of[name]
    if bits is not None:
        cols["blocked_rules"] = bits

    rows += ratio_rows(cols["mu_logprob"], cols["pi_logprob"], row)
    delta = float(get_loss("minimal_negative_mask").defaults["delta"])
    bad = int(((adv < 0) & (mu_prob - pi_prob >= delta)).sum())
    rows.append({"metric": "bad_negative", "advantage_sign": "negative", "count": bad, "threshold": delta})
    diff = pi_prob - mu_prob
    rows += [_moments("prob_diff", diff), _moments("abs_prob_diff", np.abs(diff)), *_hist("abs_prob_diff", np.abs(diff))]
    for name in ("topk_tv", "topk_kl"):
        if name in cols:
            rows += [_moments(name, cols[name]), *_hist(name, cols[name])]
    if "entropy" in cols:
        rows.append(_moments("entropy", cols["entropy"]))
    rows += routing_rows(cols)
    rows += dimension_rows(cols, step, sign, diff, blocked_by, delta)
    return rows


def routing_rows(cols: dict[str, np.ndarray]) -> list[dict]:
    """Mixture-of-experts routing (the writer's per-token figures, :mod:`trustscope.logger.experts`), over the
    tokens whose engine reported routing:

    - ``routing_agreement``: moments of the share of the engine's (layer, slot) choices the trainer's experts
      share; per MoE layer too (``dimension`` ``layer``, ``bucket`` the layer's index among the MoE layers).
    - ``routing_replaced`` (the router's own pick logged, ``router_experts``): moments of the share of the
      router's own choices the replay replaced (the replace rate), overall and per layer.
    - ``routing_fallback``, ``routing_shifted``, ``routing_reused``: counts of the tokens with that
      ``routing_fault`` bit (0 included, so a tracker's curve has every step).
    - ``routing_abs_log_ratio_agree`` / ``routing_abs_log_ratio_differ``: moments of |log pi/mu| of the tokens
      whose routing fully agrees / differs somewhere, per position bucket (``dimension`` ``position``): the
      routing split of the mismatch by position, exact at any ``token_fraction``; ``routing_abs_log_ratio``
      the same per first differing layer (``dimension`` ``routing``, -1: full agreement).
    """
    from trustscope.columns import position_bucket
    from trustscope.logger.experts import FAULTS

    rows: list[dict] = []
    for name, per_layer in (("routing_agreement", "_routing_layer_agreement"),
                            ("routing_replaced", "_routing_layer_replaced")):
        if name not in cols:
            continue
        values = cols[name]
        ok = np.isfinite(values)  # (N,) NaN: the engine reported no routing
        if ok.any():
            rows.append(_moments(name, values[ok]))
        if per_layer in cols and ok.any():
            h = cols[per_layer][ok]  # (n, L) hits of k
            top_k = _top_k(cols)
            share = h / top_k if name == "routing_agreement" else 1.0 - h / top_k
            rows += [{**_moments(name, share[:, layer]), "dimension": "layer", "bucket": layer}
                     for layer in range(share.shape[1])]
    if "routing_fault" in cols:
        fault = cols["routing_fault"]
        rows += [{"metric": f"routing_{name}", "count": int(np.count_nonzero(fault & bit))}
                 for name, bit in FAULTS.items()]
    if "routing_first_layer" in cols:
        first = cols["routing_first_layer"]
        ok = first > -2
        abs_lr = np.abs(cols["pi_logprob"].astype(np.float64) - cols["mu_logprob"].astype(np.float64))[ok]
        bucket = position_bucket(cols["pos"][ok])
        agree = first[ok] == -1
        for name, where in (("routing_abs_log_ratio_agree", agree), ("routing_abs_log_ratio_differ", ~agree)):
            rows += _bucket_moments(name, abs_lr[where], bucket[where], "position")
        rows += _bucket_moments("routing_abs_log_ratio", abs_lr, first[ok].astype(np.int64), "routing")
    return rows


def _bucket_moments(name: str, x: np.ndarray, bucket: np.ndarray, dimension: str) -> list[dict]:
    """Moments of ``x`` ``(N,)`` per value of ``bucket`` ``(N,)``, as rows of ``dimension``."""
    lows, idx = np.unique(bucket, return_inverse=True)
    return [{**_moments(name, x[idx == j]), "dimension": dimension, "bucket": int(low)} for j, low in enumerate(lows)]


def _top_k(cols: dict[str, np.ndarray]) -> int:
    """The top-k of the call's expert lists."""
    from trustscope.logger.experts import SIDES

    return next(cols[s].shape[2] for s in SIDES if s in cols)


ROUTED_VALUES = ("routing_agreement", "routing_replaced")
"""The routing figures every summary dimension's buckets carry (moments), NaN rows left out."""


def dimension_rows(cols: dict[str, np.ndarray], step: int | None, sign: np.ndarray, diff: np.ndarray,
                   blocked_by: dict[str, np.ndarray], delta: float) -> list[dict]:
    """The rows of every summary dimension (:data:`trustscope.columns.DIMENSIONS`) whose columns the call has:
    per bucket, each on its own (never crossed with the mu bucket), the same metrics as the grouped rows above:
    ``tokens`` and ``trainer_blocked`` per advantage sign, ``blocked`` per rule and sign (A != 0), ``bad_negative``,
    the moments of ``prob_diff``, ``abs_prob_diff``, ``is_weight``, ``log_ratio`` (and ``topk_tv``, ``topk_kl``,
    ``entropy`` when given) and the histograms of ``abs_prob_diff`` (and ``topk_tv``, ``topk_kl``). The
    per-response figures (``seq_*``) have no dimension rows: a response spans positions, turns and versions.

    ``sign`` ``(N,)`` indexes :data:`SIGNS`; ``diff`` ``(N,)`` is pi - mu; ``blocked_by`` rule -> ``(N,)`` the
    A != 0 tokens it blocks."""
    from trustscope.columns import DIMENSIONS

    log_ratio = cols["pi_logprob"].astype(np.float64) - cols["mu_logprob"].astype(np.float64)  # (N,)
    values = {"prob_diff": diff, "abs_prob_diff": np.abs(diff), "is_weight": np.exp(log_ratio),
              "log_ratio": log_ratio}
    values.update({name: cols[name] for name in ("topk_tv", "topk_kl", "entropy", *ROUTED_VALUES) if name in cols})
    hists = [name for name in ("abs_prob_diff", "topk_tv", "topk_kl") if name in values]
    bad = (cols["advantage"] < 0) & (-diff >= delta)  # (N,)
    rows: list[dict] = []
    for dim in DIMENSIONS:
        if any(need not in cols for need in dim.needs) or (dim.name == "staleness" and step is None):
            continue
        lows, idx = np.unique(dim.bucket(cols, step), return_inverse=True)  # idx: (N,) bucket index 0..nb-1
        nb = len(lows)
        tag = [{"dimension": dim.name, "bucket": int(low)} for low in lows]

        def by_sign(metric: str, where: np.ndarray | None, signs: int, tag: list[dict] = tag, idx: np.ndarray = idx,
                    nb: int = nb, **extra: object) -> list[dict]:
            g = sign * nb + idx  # (N,)
            counts = np.bincount(g if where is None else g[where], minlength=len(SIGNS) * nb)
            return [{"metric": metric, "advantage_sign": SIGNS[k // nb], "count": int(counts[k]), **tag[k % nb],
                     **extra} for k in np.flatnonzero(counts[: signs * nb])]

        rows += by_sign("tokens", None, 3)
        if "kept" in cols:
            rows += by_sign("trainer_blocked", ~cols["kept"], 3)
        for rule, blocked in blocked_by.items():
            rows += by_sign("blocked", blocked, 2, rule=rule)
        n_bad = np.bincount(idx[bad], minlength=nb)
        rows += [{"metric": "bad_negative", "advantage_sign": "negative", "count": int(n_bad[j]), "threshold": delta,
                  **tag[j]} for j in range(nb)]
        order = np.argsort(idx, kind="stable")  # (N,) the rows bucket by bucket
        bounds = np.searchsorted(idx[order], np.arange(nb + 1))  # (nb + 1,)
        for name, x in values.items():
            xs = np.asarray(x)[order]
            for j in range(nb):
                part = xs[bounds[j]: bounds[j + 1]]
                if name in ROUTED_VALUES:
                    part = part[np.isfinite(part)]  # NaN: the engine reported no routing for the token
                    if not len(part):
                        continue
                rows.append({**_moments(name, part), **tag[j]})
                if name in hists:
                    rows += [{**row, **tag[j]} for row in _hist(name, part)]
    return rows
