"""``trustscope explain``: a run's mismatch and each rule's blocked tokens allocated to the known causes.

Per run, and per window of steps, :func:`explain` reports

- the totals, exact over every token from the logger's summaries where the run has them (token count, each rule's
  blocked tokens, the k3 estimate of KL(mu || pi), mean |pi - mu|), and the mismatch, mean |log pi - log mu|, over
  the logged token rows;
- the mismatch and each rule's blocked tokens allocated to the causes of :data:`~trustscope.explain.causes.CAUSES`
  plus an ``unexplained`` remainder, by Shapley values over the causes' token indicators
  (:mod:`trustscope.explain.allocate`), shares adding up to 1, each with the tokens the cause touches and a 95 %
  percentile bootstrap interval over responses (Poisson resampling of the logged responses, so the interval also
  covers the sampling of ``token_fraction`` < 1, which keeps whole responses).

The indicators are computed in SQL (``explain_tokens``), grouped per response and cause pattern in SQL
(``explain_patterns``); the allocation and the bootstrap run in numpy over those few rows per response.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trustscope.explain.allocate import bootstrap_weights, pattern_sums, shapley_shares
from trustscope.explain.causes import CAUSES, UNEXPLAINED

METHOD = ("Shapley values over the causes' token indicators: a token pattern's excess over the untouched tokens' "
          "level, split evenly over the causes touching it; the rest is unexplained")
INTERVAL = "95% percentile bootstrap over responses (Poisson weights)"


@dataclass(frozen=True)
class Thresholds:
    """The indicators' thresholds (bound into ``explain_tokens``)."""

    shift_factor: float = 0.5
    """A response turn is shifted when pi one position later or earlier brings mean |log pi - log mu| below this
    fraction of the logged alignment's (the doctor's alignment check uses the same factor)."""
    shift_floor: float = 0.05
    """... and the logged mean |log pi - log mu| is at least this many nats (below it the log fits already)."""
    min_r2: float = 0.9
    """The temperature fit (log mu = a_t + log pi / T over the top-K lists) must explain this share of the
    within-position variance before a temperature or truncation is read from it."""
    temperature_tolerance: float = 0.15
    """A fitted T outside [1 / (1 + tol), 1 + tol] is a temperature mismatch; inside, a slope of 1."""
    truncation_offset: float = 0.02
    """log mu above log pi by a constant offset of at least this many nats (at slope 1) is a truncated support."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"explain threshold {name}={value!r} must be a finite number > 0")


@dataclass
class Share:
    """One cause's part of a total."""

    source: str
    share: float
    low: float
    high: float
    tokens: int
    """Logged tokens the cause touches (the remainder: tokens no cause touches)."""
    amount: float
    """The part in the total's unit (nats summed over tokens, or blocked tokens)."""
    measurable: bool = True
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "share": self.share, "interval": [self.low, self.high], "tokens": self.tokens,
                "amount": self.amount, "measurable": self.measurable, **({"note": self.note} if self.note else {})}


@dataclass
class Scope:
    """A run or a window of its steps: totals and the allocations."""

    first_step: int
    last_step: int
    tokens: int
    """Every token of the steps (the summaries), or the logged ones where the run has no summaries."""
    tokens_logged: int
    mismatch: float
    """Mean |log pi - log mu| over the logged tokens."""
    kl_k3: float
    """The k3 estimate of KL(mu || pi) per token: exact over every token from the summaries where there are."""
    mean_abs_prob_diff: float | None
    causes: list[Share]
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    """rule -> {"blocked": exact count, "blocked_logged": n, "causes": [Share]}."""
    measured: dict[str, float] | None = None
    """The trainer's measured attribution over the scope's steps (:func:`measured_shares`), where it logged one:
    cause -> share of the recomputed mismatch, ``unexplained`` among them; None where it logged none."""

    def as_dict(self) -> dict[str, Any]:
        return {"first_step": self.first_step, "last_step": self.last_step, "tokens": self.tokens,
                "tokens_logged": self.tokens_logged, "mismatch": self.mismatch, "kl_k3": self.kl_k3,
                "mean_abs_prob_diff": self.mean_abs_prob_diff, "measured": self.measured,
                "causes": [{**c.as_dict(), **({"measured": self.measured.get(c.source)} if self.measured else {})}
                           for c in self.causes],
                "rules": {r: {**v, "causes": [c.as_dict() for c in v["causes"]]} for r, v in self.rules.items()}}


@dataclass
class RunExplanation:
    run_id: str
    loss_rule: str | None
    run: Scope
    windows: list[Scope]
    window: int
    not_measurable: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "loss_rule": self.loss_rule, **self.run.as_dict(), "window_steps": self.window,
                "windows": [w.as_dict() for w in self.windows]}


@dataclass
class Explanation:
    runs: list[RunExplanation]
    thresholds: Thresholds
    replicates: int
    parity: list[dict[str, Any]] = field(default_factory=list)
    """The numerics floor measured by ``trustscope parity`` runs in the same log directory (:func:`parity_runs`)."""

    def as_dict(self) -> dict[str, Any]:
        return {"method": METHOD, "interval": INTERVAL, "replicates": self.replicates,
                "thresholds": asdict(self.thresholds), "parity": self.parity,
                "runs": [r.as_dict() for r in self.runs]}


def parity_runs(manifests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What each ``trustscope parity`` run of the log directory measured (its manifest's ``config.parity``): the
    engine and trainer settings, the sampled tokens' mean |log pi - log mu| and the full distributions' TV and KL,
    the numerics floor the ``unexplained`` share is read against."""
    out = []
    for run_id, manifest in sorted(manifests.items()):
        parity = (manifest.get("config") or {}).get("parity")
        if isinstance(parity, dict):
            full = parity.get("full_distribution") or {}
            out.append({"run_id": run_id, **{k: parity.get(k) for k in (
                "engine", "engine_dtype", "trainer_dtype", "attn_implementation", "tokens", "mean_abs_log_ratio")},
                "full_tv_mean": full.get("tv_mean"), "full_kl_mean": full.get("kl_mean"),
                "full_positions": full.get("positions"), "full_skipped": full.get("skipped")})
    return out


def explain(db: Any, run_ids: Iterable[str] | str | None = None, *, window: int | None = None,
            windows: int = 4, first_step: int | None = None, thresholds: Thresholds | None = None,
            replicates: int = 200, seed: int = 0) -> Explanation:
    """Explain every run of ``db`` (a :class:`~trustscope.db.LogDB` or a log directory), or ``run_ids``.

    ``window``: steps per window (default: the run's steps in ``windows`` windows); ``first_step``: read from there
    on; ``replicates``: bootstrap replicates for the intervals (0: none, the intervals are the point). A run unknown
    to ``db`` raises KeyError naming it; a bad setting ValueError naming it.
    """
    from trustscope.db import LogDB, connect

    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"explain: window={window!r} must be a whole number of steps >= 1")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"explain: windows={windows!r} must be a whole number >= 1")
    if isinstance(replicates, bool) or not isinstance(replicates, int) or replicates < 0:
        raise ValueError(f"explain: replicates={replicates!r} must be a whole number >= 0")
    thresholds = thresholds or Thresholds()
    if not isinstance(db, LogDB):
        with connect(db, cache=False) as opened:
            return explain(opened, run_ids, window=window, windows=windows, first_step=first_step,
                           thresholds=thresholds, replicates=replicates, seed=seed)
    from trustscope.doctor import run_manifests

    manifests = run_manifests(db)
    wanted = sorted(manifests) if run_ids is None else [run_ids] if isinstance(run_ids, str) else list(run_ids)
    missing = [r for r in wanted if r not in manifests]
    if missing:
        raise KeyError(f"run(s) {missing} not in the log directory; runs: {sorted(manifests)}")
    params = {"run_ids": wanted, "first_step": first_step}
    patterns = db.query("explain_patterns", **params, last_step=None, **asdict(thresholds))
    totals = db.query("explain_totals", **params)
    measured = db.query("explain_measured", **params)
    out = []
    for run_id in wanted:
        rows = patterns[patterns["run_id"] == run_id]
        if rows.empty:
            continue
        loss_rule = manifests[run_id].get("loss_rule")
        bits = _bit_rules(db, run_id)
        if bits is not None and rows["blocked_rules"].notna().all():
            rule_rows, sources = _rules_from_bits(rows, bits, loss_rule)
        else:  # no bits to read (an import, an older log): every rule evaluated in SQL
            rule_rows = db.query("explain_rule_blocks", **{**params, "run_ids": [run_id]}, **asdict(thresholds))
            sources = {col[len("blocks_"):]: "rule_blocks" for col in rule_rows.columns if col.startswith("blocks_")}
        run = _explain_run(run_id, loss_rule, rows, rule_rows, sources, totals[totals["run_id"] == run_id],
                           window, windows, replicates, seed)
        mine = measured[measured["run_id"] == run_id]
        for scope in (run.run, *run.windows):
            scope.measured = measured_shares(mine[(mine["step"] >= scope.first_step)
                                                  & (mine["step"] <= scope.last_step)])
        out.append(run)
    return Explanation(out, thresholds, replicates, parity_runs(manifests))


KEYS = ["step", "rank", "sample_id"]
FLAGS = [c.column for c in CAUSES]
RULE_SOURCES = {
    "kept": "the trainer's own mask (kept)",
    "bits": "the logger's blocked_rules bits (the rule at the parameters the files' footer lists)",
    "rule_blocks": "rule_blocks (every rule evaluated in SQL at the connection's parameters)",
}
"""Where a rule's blocked tokens are read from, per rule in the JSON (``from``)."""


MEASURED_CAUSES = {"temperature": "temperature", "truncation": "truncation", "staleness": "staleness",
                   "routing": "routing", "numerics": UNEXPLAINED, "unexplained": UNEXPLAINED}
"""The trainer's measured causes (:data:`trustscope.train.attribution.CAUSES`) -> the cause they are compared
with: the inferred ``unexplained`` holds numerics (the engine's dtype) and whatever no recompute removes."""


def measured_shares(rows: Any) -> dict[str, float] | None:
    """The measured shares over some steps (rows of the ``explain_measured`` query: run_id, step, name, value),
    each step weighted by its recomputed mismatch times its tokens (the nats it allocates), mapped onto the
    inferred causes (:data:`MEASURED_CAUSES`); None where no step logged one."""
    if rows is None or rows.empty:
        return None
    wide = rows.pivot_table(index="step", columns="name", values="value", aggfunc="mean")
    if "mismatch" not in wide or "tokens" not in wide:
        return None
    nats = (wide["mismatch"] * wide["tokens"]).fillna(0.0)
    if float(nats.sum()) <= 0:
        return None
    out: dict[str, float] = {}
    for name, target in MEASURED_CAUSES.items():
        if name in wide:
            out[target] = out.get(target, 0.0) + float((wide[name].fillna(0.0) * nats).sum() / nats.sum())
    return out


def _bit_rules(db: Any, run_id: str) -> dict[str, int] | None:
    """rule -> its bit in ``blocked_rules``, when every tokens file of the run lists the same rules (their footer's
    list); None when a file lists none or the files disagree."""
    import json

    from trustscope.query.runs import data_files, footer
    from trustscope.runformat import BLOCKED_RULES_META

    dirs = [d for d in db.runs_dirs if d.name == run_id]
    lists = set()
    for f in (data_files(dirs[0], "tokens") if dirs else []):
        meta = footer(f)
        listed = None if isinstance(meta, str) else (meta.metadata or {}).get(BLOCKED_RULES_META.encode())
        if listed is None:
            return None
        lists.add(listed)
    if len(lists) != 1:
        return None
    try:
        return {name: bit for bit, (name, _) in enumerate(json.loads(lists.pop()))}
    except (ValueError, TypeError):
        return None


def _rules_from_bits(rows: Any, bits: dict[str, int], loss_rule: str | None) -> tuple[Any, dict[str, str]]:
    """Per response and cause pattern, each rule's blocked tokens with A != 0, read from the grouped bits; the run's
    own rule from ``kept``, the mask the trainer applied."""
    import pandas as pd

    signed = rows["n_tokens"].to_numpy(dtype=np.int64) * rows["signed"].to_numpy(dtype=bool)  # (N,)
    word = rows["blocked_rules"].to_numpy(dtype=np.int64)
    cols = {"n_signed": signed}
    sources = {}
    for rule, bit in bits.items():
        cols[f"blocks_{rule}"] = ((word >> bit) & 1) * signed
        sources[rule] = "bits"
    if loss_rule and loss_rule != "none":
        cols[f"blocks_{loss_rule}"] = (~rows["kept"].to_numpy(dtype=bool)) * signed
        sources[loss_rule] = "kept"
    frame = pd.concat([rows[KEYS + FLAGS].reset_index(drop=True), pd.DataFrame(cols)], axis=1)
    return frame.groupby(KEYS + FLAGS, dropna=False, sort=False).sum().reset_index(), sources


def _explain_run(run_id: str, loss_rule: str | None, rows: Any, rule_rows: Any, sources: dict[str, str],
                 totals: Any, window: int | None, windows: int, replicates: int, seed: int) -> RunExplanation:
    steps = np.sort(rows["step"].unique())
    first, last = int(steps[0]), int(steps[-1])
    width = window or max(1, math.ceil((last - first + 1) / windows))
    not_measurable = {}
    for c in CAUSES:
        if rows[c.column].isna().all():
            not_measurable[c.source] = "not measurable: needs " + ", ".join(f"`{n}`" for n in c.needs)
    scopes = [_scope(rows, rule_rows, sources, totals, first, last, not_measurable, replicates, seed)]
    starts = range(first, last + 1, width)
    per_window = []
    for lo in starts:
        hi = min(lo + width - 1, last)
        part = rows[(rows["step"] >= lo) & (rows["step"] <= hi)]
        if not part.empty:
            per_window.append(_scope(part, rule_rows[(rule_rows["step"] >= lo) & (rule_rows["step"] <= hi)], sources,
                                     totals[(totals["step"] >= lo) & (totals["step"] <= hi)], lo, hi,
                                     not_measurable, replicates, seed))
    return RunExplanation(run_id, loss_rule, scopes[0], per_window, width, not_measurable)


def _patterns(rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """``(flags (N, C), pattern (N,), table (P, C), group (N,), n_groups)`` of grouped rows: which causes each row
    has, its pattern's index, each pattern's causes, and the response of each row."""
    flags = np.stack([rows[c.column].fillna(False).to_numpy(dtype=bool) for c in CAUSES], axis=1)  # (N, C)
    codes = flags @ (1 << np.arange(len(CAUSES)))  # (N,) pattern code
    uniq, pattern = np.unique(codes, return_inverse=True)
    table = ((uniq[:, None] >> np.arange(len(CAUSES))[None, :]) & 1).astype(bool)  # (P, C)
    keys = np.stack([rows[k].to_numpy(dtype=np.int64) for k in KEYS], axis=1)  # (N, 3)
    group = np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1) if len(keys) else np.zeros(0, np.int64)
    return flags, pattern, table, group, int(group.max()) + 1 if len(group) else 0


def _scope(rows: Any, rule_rows: Any, sources: dict[str, str], totals: Any, first: int, last: int,
           not_measurable: dict[str, str], replicates: int, seed: int) -> Scope:
    n_tokens = rows["n_tokens"].to_numpy(dtype=np.float64)
    grouped = {id(rows): _patterns(rows), id(rule_rows): _patterns(rule_rows)}  # once per frame
    flags = grouped[id(rows)][0]
    touched = (flags.T @ n_tokens).astype(np.int64)  # (C,) tokens each cause touches
    untouched = int(n_tokens[~flags.any(axis=1)].sum())
    weights_of = {key: bootstrap_weights(g[4], replicates, seed) if replicates else None for key, g in grouped.items()}

    def allocate(frame: Any, value: np.ndarray, count: np.ndarray) -> list[Share]:
        _, pattern, table, group, n_groups = grouped[id(frame)]
        n_patterns = len(table)
        weights = weights_of[id(frame)]
        point = shapley_shares(pattern_sums(group, pattern, value, n_groups, n_patterns),
                               pattern_sums(group, pattern, count, n_groups, n_patterns), table)
        shares, amounts = point[0][0], point[1][0]
        if weights is not None:
            boot = shapley_shares(pattern_sums(group, pattern, value, n_groups, n_patterns, weights),
                                  pattern_sums(group, pattern, count, n_groups, n_patterns, weights), table)[0]
            low, high = np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0)
        else:
            low = high = shares
        out = []
        for i, c in enumerate(CAUSES):
            note = not_measurable.get(c.source, "")
            out.append(Share(c.source, float(shares[i]), float(low[i]), float(high[i]), int(touched[i]),
                             float(amounts[i]), measurable=not note, note=note))
        out.append(Share(UNEXPLAINED, float(shares[-1]), float(low[-1]), float(high[-1]), untouched,
                         float(amounts[-1])))
        return out

    logged = int(n_tokens.sum())
    sum_abs = rows["sum_abs_log_ratio"].to_numpy(dtype=np.float64)
    exact = _totals(totals)
    kl = exact["kl_k3"] if exact["tokens"] else float(rows["sum_k3"].sum()) / max(logged, 1)
    scope = Scope(first, last, exact["tokens"] or logged, logged, float(sum_abs.sum()) / max(logged, 1), kl,
                  exact["mean_abs_prob_diff"], allocate(rows, sum_abs, n_tokens))
    signed = rule_rows["n_signed"].to_numpy(dtype=np.float64)
    for rule in sorted(sources):
        blocked = rule_rows[f"blocks_{rule}"].fillna(0).to_numpy(dtype=np.float64)
        exact_blocked = exact["trainer_blocked"] if sources[rule] == "kept" else exact["blocked"].get(rule)
        scope.rules[rule] = {"blocked": int(blocked.sum()) if exact_blocked is None else exact_blocked,
                             "blocked_logged": int(blocked.sum()), "from": RULE_SOURCES[sources[rule]],
                             "causes": allocate(rule_rows, blocked, signed)}
    return scope


def _totals(totals: Any) -> dict[str, Any]:
    """The exact totals of a set of steps from the summaries' rows (zero tokens: the run has no summaries)."""
    def metric(name: str) -> Any:
        return totals[totals["metric"] == name]

    n = int(metric("tokens")["count"].sum())
    out: dict[str, Any] = {"tokens": n, "kl_k3": float("nan"), "mean_abs_prob_diff": None, "blocked": {},
                           "trainer_blocked": None}
    if n:
        w, lr = metric("is_weight"), metric("log_ratio")
        out["kl_k3"] = float((w["sum"].sum() - lr["sum"].sum()) / n - 1.0)
        out["mean_abs_prob_diff"] = float(metric("abs_prob_diff")["sum"].sum() / n)
        blocked = metric("blocked")
        out["blocked"] = {str(r): int(c) for r, c in blocked.groupby("rule")["count"].sum().items()}
        out["trainer_blocked"] = int(metric("trainer_blocked")["count"].sum())
    return out


def explain_logdir(logdir: str | Path, **kwargs: Any) -> Explanation:
    """:func:`explain` over a log directory opened for the occasion."""
    return explain(logdir, **kwargs)
