"""The named analyses the CLI, the report and the dashboard call, as pandas DataFrames: pandas is imported when
an analysis returns one, not when the query layer is imported.

:class:`Overview` is the Runs page's and the report's source: exact from the summaries table where a run has one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trustscope import runformat
from trustscope.query.rules import ANALYSIS_DEFAULTS
from trustscope.query.runs import logged_fraction

if TYPE_CHECKING:
    import pandas as pd


OVERVIEW_COLUMNS = ("run_id", "step", "n_tokens", "n_samples", "reward_mean", "reward_std", "length_mean",
                    "mismatch_mean", "mismatch_max", "prob_diff_max", "prob_diff_min", "topk_tv_mean", "topk_tv_max",
                    "topk_kl_mean", "topk_kl_max", "entropy_mean", "n_positive", "n_negative", "n_zero_advantage",
                    "n_bad_negative", "bad_negative_rate", "bad_negative_delta", "n_nonzero_advantage",
                    "n_trainer_blocked", "trainer_blocked_frac")
"""The per-step columns of :attr:`Overview.steps`: ``sql/views/summary_steps.sql``'s, named and defined as in
``step_summary``."""


BLOCKED_COLUMNS = ("run_id", "step", "rule", "advantage_side", "n_blocked", "n_tokens", "blocked_frac")


@dataclass


class Overview:
    """The overview figures of some runs, exact where a run has a summaries table (see :meth:`LogDB.overview`).

    ``steps``: one row per (run, step), :data:`OVERVIEW_COLUMNS`. ``blocked``: one row per (run, step, rule,
    advantage side), :data:`BLOCKED_COLUMNS`: n_blocked of n_tokens, side 'all' over the tokens with A != 0,
    'positive' A > 0, 'negative' A < 0. ``sources``: one row per run: run_id, exact (from the summaries table,
    over every token) and token_fraction (what the logger kept of the token rows, from run.json), and ``source``,
    a sentence saying which, for captions.
    """

    steps: pd.DataFrame
    blocked: pd.DataFrame
    sources: pd.DataFrame

    def blocked_totals(self, labels: dict[str, str] | None = None) -> pd.DataFrame:
        """``run_id, rule, n_blocked, n_tokens, blocked_frac`` over every step (tokens with A != 0), one row per
        run (or label of ``labels``) and rule that blocks anything: counts summed, then divided (a run's fraction
        is never a mean of its steps' fractions)."""
        per_step = self.blocked_by_rule(labels)
        out = per_step.groupby(["run_id", "rule"], as_index=False)[["n_blocked", "n_tokens"]].sum()
        out["blocked_frac"] = out["n_blocked"] / out["n_tokens"].where(out["n_tokens"] > 0)
        return out

    def blocked_by_rule(self, labels: dict[str, str] | None = None) -> pd.DataFrame:
        """``run_id, step, rule, n_blocked, n_tokens, blocked_frac`` over the tokens with A != 0, for the rules
        that block at least one token here. ``labels`` maps run_id -> a label (a seed group): the runs of one
        label are added up per step (counts summed, then divided), and ``run_id`` holds the label."""
        df = self.blocked[self.blocked["advantage_side"] == "all"]
        blocking = df.groupby("rule")["n_blocked"].sum()
        df = df[df["rule"].isin(blocking[blocking > 0].index)]
        if labels:
            df = df.assign(run_id=df["run_id"].map(lambda r: labels.get(r, r)))
        out = df.groupby(["run_id", "rule", "step"], as_index=False)[["n_blocked", "n_tokens"]].sum()
        out["blocked_frac"] = out["n_blocked"] / out["n_tokens"].where(out["n_tokens"] > 0)
        return out[["run_id", "step", "rule", "n_blocked", "n_tokens", "blocked_frac"]]

    def bad_updates(self) -> pd.DataFrame:
        """Per run and step, the ``bad_negative_updates`` view's columns: n_tokens, n_negative, n_bad_negative,
        bad_negative_rate (of all the step's tokens), reward_mean, reward_std, reward_change (|reward_mean -
        the previous step's|)."""
        df = self.steps[["run_id", "step", "n_tokens", "n_negative", "n_bad_negative", "bad_negative_rate",
                         "reward_mean", "reward_std"]].sort_values(["run_id", "step"])
        return df.assign(reward_change=df.groupby("run_id")["reward_mean"].diff().abs()).reset_index(drop=True)


def source_sentence(exact: bool, token_fraction: float | None) -> str:
    """How a run's overview figures were obtained, for captions and tables."""
    if exact:
        return "exact: every token (summaries table)"
    if token_fraction is not None and token_fraction < 1:
        return f"from logged rows: a sample of {token_fraction:.0%} of tokens"
    return "from logged rows (every token logged)"


class NamedAnalyses:
    """The analyses of a :class:`~trustscope.query.connection.LogDB`, each a view read through its ``_frame`` (rows
    whose columns take given values, the kept aggregates brought up to date first)."""

    runs_dirs: list[Path]
    broken_runs: dict[str, str]

    def runs(self) -> pd.DataFrame:
        """One row per run: run_id, status, schema_version, n_steps, first_step, last_step, n_samples,
        n_response_tokens, mean_reward, manifest (JSON text). A run whose manifest cannot be read has status
        ``broken`` (the reason is in :attr:`broken_runs`); the other runs are unaffected. Read once per state of the
        run files (:meth:`version`): a report or a page asks several times."""
        key = self.version()
        memo = getattr(self, "_runs_memo", None)
        if memo is not None and memo[0] == key:
            return memo[1].copy()
        df = self._runs_frame()
        self._runs_memo = (key, df)
        return df.copy()

    def _runs_frame(self) -> pd.DataFrame:
        df = self._frame("runs", refresh=True)
        if not self.broken_runs:
            return df
        missing = sorted(set(self.broken_runs) - set(df["run_id"]))
        import pandas as pd

        df = pd.concat([df, pd.DataFrame({"run_id": missing, "n_steps": 0, "n_samples": 0,
                                                            "n_response_tokens": 0})], ignore_index=True) if missing else df
        df.loc[df["run_id"].isin(list(self.broken_runs)), "status"] = "broken"
        df["manifest"] = df["manifest"].astype(object).where(df["manifest"].notna(), None)  # no NaN for "none"
        return df.sort_values("run_id").reset_index(drop=True)

    def step_summary(self, run_ids: Sequence[str] | str | None = None) -> pd.DataFrame:
        """One row per (run, step), from the kept per-file aggregates (see ``sql/views/step_summary.sql``).

        Columns: run_id, step, n_tokens, n_samples, reward_mean, reward_std, length_mean, mismatch_mean
        (mean |pi - mu|), mismatch_max, prob_diff_max / prob_diff_min (signed pi - mu), binary_kl_mean/_max,
        topk_tv_mean/_max, topk_kl_mean/_max, ratio_min/_max, entropy_mean, n_positive, n_negative,
        n_zero_advantage, n_bad_negative, bad_negative_rate, n_nonzero_advantage, n_trainer_blocked,
        trainer_blocked_frac, and per rule R: n_blocked__R and blocked_frac__R (over the tokens with A != 0, which
        carry gradient), n_blocked_pos__R / blocked_frac_pos__R (A > 0), n_blocked_neg__R / blocked_frac_neg__R
        (A < 0).
        """
        return self._frame("step_summary", where={"run_id": run_ids}, refresh=True)

    def summaries(self, run_ids: Sequence[str] | str | None = None,
                  metrics: Sequence[str] | str | None = None, dimension: str | None = None) -> pd.DataFrame:
        """The exact per-step summaries the logger computed over every token (whatever ``token_fraction`` kept),
        merged over micro-batches and ranks (see ``sql/views/summaries.sql`` and :mod:`trustscope.logger.summaries`).

        Columns: run_id, step, metric, rule, advantage_sign, mu_bucket, mu_low, bin_low, bin_high, threshold,
        count, sum, sum_sq, min, max, mean, fraction, cum_fraction, step_tokens. For example the blocked fraction
        of rule R on A < 0 tokens of mu bucket b is ``fraction`` of the row (metric 'blocked', rule R, advantage_sign
        'negative', mu_bucket b); the median |pi - mu| is the bin_high of the first 'abs_prob_diff_hist' row with
        cum_fraction >= 0.5. Runs logged before the summaries table existed have no rows.

        ``dimension``: None (default) gives the rows grouped by advantage sign x mu bucket; a summary dimension's
        name (``position``, ``turn``, ``staleness``: :data:`trustscope.columns.DIMENSIONS`) gives its rows instead,
        split by ``bucket`` (``bucket_label``), each metric once per bucket; ``"*"`` gives both.
        """
        frame = self._frame("summaries", where={"run_id": run_ids, "metric": metrics}, refresh=True)
        if dimension == "*":
            return frame
        keep = frame["dimension"].isna() if dimension is None else frame["dimension"] == dimension
        return frame[keep].reset_index(drop=True)

    def overview(self, run_ids: Sequence[str] | str | None = None) -> Overview:
        """The overview figures of every run with a logged step (or of ``run_ids``), the one source of the Runs
        page and of ``trustscope report``: exact from the summaries table where a run has one (``summary_steps``,
        ``summary_blocked``: a few hundred rows a step, whatever the run's token count), else from its logged
        token rows (``step_summary``, ``blocked_fractions``: a sample when ``token_fraction`` < 1, which
        :attr:`Overview.sources` says). Token rows are read only for the runs without summaries.
        """
        import pandas as pd

        wanted = None if run_ids is None else [run_ids] if isinstance(run_ids, str) else list(run_ids)
        self.refresh()
        fractions = {}
        for run in self.runs_dirs:  # run.json only: the overview reads no samples or token file to list runs
            try:
                manifest = json.loads((run / runformat.MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict):
                fractions[manifest.get("run_id") or run.name] = logged_fraction(manifest)
        ids = [r for r in fractions if wanted is None or r in wanted]
        if not ids:
            return Overview(pd.DataFrame(columns=list(OVERVIEW_COLUMNS)), pd.DataFrame(columns=list(BLOCKED_COLUMNS)),
                            pd.DataFrame(columns=["run_id", "exact", "token_fraction", "source"]))
        steps = [self._frame("summary_steps", where={"run_id": ids})]
        blocked = [self._frame("summary_blocked", where={"run_id": ids})]
        exact = set(steps[0]["run_id"])
        chosen = self.chosen_rules()
        if chosen and exact:  # the summaries hold those rules at their defaults: counted from the logged rows
            blocked[0] = blocked[0][~blocked[0]["rule"].isin(chosen)]
            blocked.append(self.blocked_fractions(sorted(exact), chosen)[list(BLOCKED_COLUMNS)])
        rest = [r for r in ids if r not in exact]
        if rest:
            logged = self.step_summary(rest).assign(bad_negative_delta=ANALYSIS_DEFAULTS["bad_negative_delta"])
            steps.append(logged[list(OVERVIEW_COLUMNS)])
            blocked.append(self.blocked_fractions(rest)[list(BLOCKED_COLUMNS)])
        shown = sorted(exact | set(steps[-1]["run_id"] if rest else ()))
        sources = pd.DataFrame({"run_id": shown, "exact": [r in exact for r in shown],
                                "token_fraction": [fractions[r] for r in shown]})
        sources["source"] = [source_sentence(e, f) for e, f in zip(sources["exact"], sources["token_fraction"],
                                                                   strict=True)]
        frames = [f for f in steps if len(f)]
        return Overview(
            steps=(pd.concat(frames, ignore_index=True) if frames else steps[0]).sort_values(["run_id", "step"])
            .reset_index(drop=True),
            blocked=pd.concat([f for f in blocked if len(f)] or blocked[:1], ignore_index=True),
            sources=sources)

    def chosen_rules(self) -> list[str]:
        """The rules this connection evaluates at parameters other than their defaults (``rule_params``)."""
        from trustscope.losses import get_loss
        from trustscope.query.rules import bindable

        params: dict = getattr(self, "rule_params", {})
        return sorted(r for r, p in params.items() if p != bindable(get_loss(r).defaults))

    def blocked_fractions(self, run_ids: Sequence[str] | str | None = None,
                          rules: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Long form of the blocked counts: run_id, step, rule, advantage_side ('all': A != 0, 'positive',
        'negative'), n_blocked, n_tokens, blocked_frac. Every rule on the same tokens (a run's own rule at its
        parameters, the others at their defaults or the caller's choice)."""
        return self._frame("blocked_fractions", where={"run_id": run_ids, "rule": rules}, refresh=True)

    def bad_negative_updates(self, run_ids: Sequence[str] | str | None = None,
                             delta: float | None = None) -> pd.DataFrame:
        """Per step: the rate of bad negative updates (A < 0 and mu - pi >= delta) beside the reward's level and
        fluctuation. ``delta`` defaults to minimal_negative_mask's default (0.5); the default is read from the
        kept aggregates, any other value scans the tokens.

        Columns: run_id, step, n_tokens, n_negative, n_bad_negative, bad_negative_rate, reward_mean, reward_std,
        reward_change (|reward_mean - previous step's|).
        """
        if delta is None or delta == ANALYSIS_DEFAULTS["bad_negative_delta"]:
            return self._frame("bad_negative_updates", where={"run_id": run_ids}, refresh=True)
        if not (isinstance(delta, int | float) and math.isfinite(delta) and delta >= 0):
            raise ValueError(f"delta={delta!r} must be a finite number >= 0")
        return self._frame("bad_negative_updates_scan", where={"run_id": run_ids}, refresh=True,
                           bad_negative_delta=float(delta))

    def clipped_tokens(self, run_ids: Sequence[str] | str | None = None, rules: Sequence[str] | str | None = None,
                       top: int = 30) -> pd.DataFrame:
        """Token texts ranked by how often each rule blocks them (the ``top`` first per run and rule), counted over
        the tokens that carry gradient (A != 0).

        Columns: run_id, rule, rank, token_id, token_text, n_blocked, n_occurrences, block_rate, block_share,
        mu_prob_mean, mu_bucket, entropy_mean.
        """
        if top < 1:
            raise ValueError(f"top={top} must be >= 1")
        df = self._frame("clipped_tokens", where={"run_id": run_ids, "rule": rules}, refresh=True)
        return df[df["rank"] <= top].reset_index(drop=True)

    def ratio_vs_divergence(self, run_ids: Sequence[str] | str | None = None,
                            divergences: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Binned 2-D histogram of the ratio against each divergence by mu bucket (log10 bins).

        Columns: run_id, mu_bucket, divergence ('binary_tv', 'binary_kl', 'topk_tv', 'topk_kl'), ratio_bin,
        ratio_lo, ratio_hi, divergence_bin, divergence_lo, divergence_hi, n.
        """
        return self._frame("ratio_vs_divergence", where={"run_id": run_ids, "divergence": divergences},
                           refresh=True)

    def sample_tokens(self, run_id: str, step: int, sample_id: int) -> pd.DataFrame:
        """Every token of one response in order, for a token explorer: token_metrics columns (token_text,
        mu_prob, pi_prob, ratio, binary_tv/kl, topk_tv/kl, advantage, entropy, kept, ...) plus blocks_<rule>."""
        df = self._frame("sample_tokens", where={"run_id": [run_id], "step": [int(step)],
                                                 "sample_id": [int(sample_id)]}, refresh=True)
        return df.sort_values("pos").reset_index(drop=True)

    def equal_budget(self, run_ids: Sequence[str] | str | None = None, budget: float | None = None,
                     rules: Sequence[str] | str | None = None, max_rows: int | None = None) -> pd.DataFrame:
        """Per run and rule: the threshold at which the rule blocks the same share of the run's tokens with
        A != 0 as a reference, the run's own rule (default) or ``budget`` (a share in (0, 1)); see
        :mod:`trustscope.query.budget`.

        Columns: run_id, rule, param (the rule's threshold parameter), default (its value here: the run's own for
        its own rule, else the default or the caller's choice), value (the threshold found), value_low /
        value_high (the bracket the source allows, with n_blocked_low / n_blocked_high: what each end blocks;
        equal to value from the logged rows), n_blocked of n_tokens (at value), blocked_frac, target_frac,
        target_blocked, reference (a sentence), setting (the rule at value as a rule setting, ``rule@value``,
        which ``--rule`` and ``TokenLogger(rule_settings=...)`` read back), params (JSON: the mask's parameters
        at value), source ('summaries (...)' or 'logged rows (...)'), note (exactness, or why there is no value:
        no scalar threshold, no reference, out of bounds, not reachable). ``max_rows``: leave out (with a note)
        the cuts that would read more than this many logged token rows of a run (the report's limit).
        """
        from trustscope.query.budget import equal_budget

        return equal_budget(self, run_ids, budget, rules, max_rows)

    def threshold_curve(self, run_id: str, rules: Sequence[str] | str | None = None) -> pd.DataFrame:
        """The blocked share of run ``run_id``'s tokens with A != 0 against each rule's threshold (rules with a
        scalar threshold), one row per bin edge of scale: run_id, rule, param, value (the threshold), scale,
        n_blocked, n_tokens, blocked_frac, default (the threshold the rule is evaluated at here), source."""
        from trustscope.query.budget import threshold_curve

        return threshold_curve(self, run_id, rules)

    def budget_picks(self, run_id: str, budget: pd.DataFrame) -> pd.DataFrame:
        """Which tokens each rule blocks on ``run_id`` at the thresholds of ``budget`` (an :meth:`equal_budget`
        frame), from the logged rows: rule ('(all tokens)': every token with A != 0), dimension ('mu_bucket',
        'advantage_sign', 'entropy_bucket', 'position', and 'turn' and 'staleness' where the run logged them),
        value, n_blocked, share (of the rule's blocked tokens)."""
        from trustscope.query.budget import cuts_of

        cuts = cuts_of(budget, self, run_id)
        df = self.query("budget_picks", run_id=run_id, cuts=cuts or [{"rule": "", "u": 0.0}])
        totals = df.groupby(["rule", "dimension"])["n_blocked"].transform("sum")
        return df.assign(share=df["n_blocked"] / totals)

    def budget_overlap(self, run_id: str, budget: pd.DataFrame, rule_a: str, rule_b: str) -> pd.DataFrame:
        """Two rules on ``run_id`` at the thresholds of ``budget`` (an :meth:`equal_budget` frame), from the
        logged rows: per token text, n tokens that both block ('both'), only ``rule_a`` ('only a'), only
        ``rule_b`` ('only b'). Columns: pick, token_text, n."""
        from trustscope.query.budget import cuts_of

        cuts = {c["rule"]: c["u"] for c in cuts_of(budget, self, run_id)}
        missing = [r for r in (rule_a, rule_b) if r not in cuts]
        if missing:
            raise ValueError(f"rule {missing[0]!r} has no equal-budget threshold on run {run_id!r}")
        return self.query("budget_overlap", run_id=run_id, rule_a=rule_a, u_a=cuts[rule_a], rule_b=rule_b,
                          u_b=cuts[rule_b])

    def samples(self, run_ids: Sequence[str] | str | None = None, steps: Sequence[int] | int | None = None,
                limit: int = 1000) -> pd.DataFrame:
        """Responses: run_id, step, rank, sample_id, prompt_id, prompt, response, reward, advantage, length,
        finish_reason, source_file (at most ``limit`` rows)."""
        return self._frame("samples", where={"run_id": run_ids, "step": steps}, refresh=True, limit=limit)
