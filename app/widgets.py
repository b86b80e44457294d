"""Pickers and display helpers shared by the pages; choices are remembered across pages in the session state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from app import data
from trustscope import early_warning, figures
from trustscope.losses import get_loss
from trustscope.rule_settings import explicit_name, validated

if TYPE_CHECKING:
    import plotly.graph_objects as go


def pick_groups(runs: pd.DataFrame, limit: int = 4) -> tuple[list[str], bool]:
    """Seed groups (or single runs) to compare, and whether seeds are grouped; by default
    :func:`app.data.default_comparison` (the PPO-clip baseline, then one configuration per other rule)."""
    grouped = st.toggle("Group seeds (mean, band = min..max)", value=True, key="group_seeds")
    column = "group" if grouped else "run_id"
    options = runs[column].drop_duplicates().tolist()
    remembered = [r for r in st.session_state.get(f"_{column}", []) if r in options]
    default = data.default_comparison(runs, column, limit)
    label = "Configurations (seeds averaged)" if grouped else "Runs"
    chosen = st.multiselect(label, options, default=remembered or default, key=f"{column}_picker")
    st.session_state[f"_{column}"] = chosen
    st.session_state["_grouped"] = grouped
    return chosen, grouped


def pick_run(runs: pd.DataFrame, label: str = "Run") -> str:
    """One run: the one picked last on any page, else the first of the Runs page's comparison (as picked there,
    else its default, :func:`app.data.default_run`), so every drill-down page opens on the same run."""
    ids = runs["run_id"].tolist()
    remembered = [r for r in st.session_state.get("_runs", []) if r in ids]
    if not remembered:
        remembered = [_first_compared(runs)]
    run = st.selectbox(label, ids, index=ids.index(remembered[0]), key="run_picker",
                       format_func=lambda r: _run_label(runs, r))
    st.session_state["_runs"] = [run, *[r for r in remembered if r != run]]
    return run


def _first_compared(runs: pd.DataFrame) -> str:
    """The first run of the comparison the Runs page shows (picked there in this session, else its default)."""
    column = "group" if st.session_state.get("_grouped", True) else "run_id"
    picked = [g for g in st.session_state.get(f"_{column}", []) if g in set(runs[column])]
    if not picked:
        return data.default_run(runs)
    members = runs.loc[runs[column] == picked[0], "run_id"]
    focus = data.default_run(runs)  # the run the dashboard was opened for, when it is in that group
    return focus if focus in set(members) else str(members.iloc[0])


def _run_label(runs: pd.DataFrame, run_id: str) -> str:
    rule = runs.set_index("run_id").loc[run_id, "loss_rule"]
    return f"{run_id}  ({rule})" if isinstance(rule, str) and rule not in run_id else run_id


def pick_steps(run_id: str, key: str = "steps") -> tuple[int, int]:
    """A step window within one run; by default the last steps holding at most ``data.WINDOW_TOKENS`` tokens,
    so token-level pages cost the same however long the run grows."""
    first, last = data.step_range(run_id)
    if first == last:
        st.caption(f"Step {first}")
        return first, last
    start = data.window_start(run_id)
    window = st.slider("Steps", first, last, (start, last), key=f"{key}_{run_id}")
    if window[0] > first:
        st.caption(f"Token-level charts read the last steps up to {data.WINDOW_TOKENS:,} tokens by default; "
                   "widen the window for more (slower on large runs).")
    return window


def pick_rules(available: list[str], applied: str | None = None, key: str = "rules_picker") -> list[str]:
    """Rules to show side by side, in registry order (default: the run's own rule, the PPO clip baseline and the
    DPPO rules, as far as they block anything here)."""
    available = figures.rule_order(available)
    remembered = [r for r in st.session_state.get(f"_{key}", []) if r in available]
    wanted = {applied, data.BASELINE_RULE, "grpo", data.COUNTERFACTUAL_RULE, "dppo_topk_tv", "ppo_lowprob_relax",
              "minimal_negative_mask"}
    default = remembered or [r for r in available if r in wanted] or available[:6]
    chosen = st.multiselect("Rules", available, default=default, key=key,
                            format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
    st.session_state[f"_{key}"] = chosen
    return figures.rule_order(chosen)


def require_runs() -> pd.DataFrame:
    """The runs table, or a message and a stop when the log directory holds none with data yet."""
    runs = data.runs()
    if runs.empty:
        st.info("No run in this log directory has logged a step yet. Runs still being written appear here "
                "once their first step lands; the Live page refreshes on its own.")
        st.stop()
    return runs


def chart(fig: go.Figure | dict, key: str, empty: str) -> None:
    """Draw ``fig`` (a figure or :func:`app.data.figure`'s JSON), or say ``empty`` (why there is nothing and what
    to change) when no trace holds a point."""
    if figures.has_data(fig):
        st.plotly_chart(fig, key=key)
    else:
        st.info(empty, icon=":material/info:")


def _md(text: str) -> str:
    """``text`` with Markdown's markup characters escaped, for a line of ``st.markdown``."""
    return "".join("\\" + c if c in "\\`*_[]$<>#|~" else c for c in str(text))


def warning_badge(run_ids: list[str]) -> None:
    """A red line per run whose collapse early warning holds (:func:`trustscope.early_warning.warning_outcome`:
    the reward then collapsed, or it is still on at the last step), with the first step, why it fired and why it
    holds; a grey line per run whose warning fired but was not borne out, with the figures that say so (the
    report's ``!`` marks the same runs). In an expander when many."""
    if not run_ids:
        return
    warnings = data.collapse_warnings(run_ids)
    firsts = early_warning.first_warnings(warnings)
    causes = data.warning_causes(warnings)  # each warning names the cause that drives it (trustscope explain)
    firsts = {run_id: f"{text}; {causes[run_id]}" if run_id in causes else text for run_id, text in firsts.items()}
    lines, detector = data.WARNING_LINES, early_warning.DETECTOR
    how = lines.describe()
    if warnings["score"].notna().any():
        how.insert(0, f"the early-warning score (a logistic score over the last {detector.window} steps' "
                      f"{', '.join(early_warning.DETECTOR_LABELS[n] for n in detector.signals)}, fitted on collapsing "
                      f"runs, docs/experiments.md; on runs logged with those summaries) reaches "
                      f"{detector.threshold:.2f}")
    if not firsts:
        st.caption(f"No collapse warning. A step warns when {', or '.join(how)}.")
        return
    outcomes = {run_id: early_warning.warning_outcome(warnings, run_id) or (True, "") for run_id in firsts}
    held = [r for r in firsts if outcomes[r][0]]
    title = (f":material/warning: Collapse warning holds on {len(held)} of {len(run_ids)} runs" if held else
             f":material/info: No collapse warning holds ({len(firsts)} of {len(run_ids)} runs warned, not borne out)")
    if held and len(held) < len(firsts):
        title += f" ({len(firsts) - len(held)} more warned, not borne out)"
    # open where the few lines under it are all warnings that hold; closed under a title that counts them otherwise
    where = (st.expander(title, expanded=0 < len(held) == len(firsts) <= 2) if len(firsts) > 1
             else st.container())
    with where:
        for run_id in held:  # why it holds first, in red; then when and why it fired (a line that wraps, not cut)
            st.markdown(f":red[:material/warning: **{_md(run_id)}**: {_md(outcomes[run_id][1])}.] "
                        f"{_md(firsts[run_id][:1].upper() + firsts[run_id][1:])}.")
        for run_id in (r for r in firsts if r not in held):
            st.caption(_md(f"{run_id}: {firsts[run_id]}, {outcomes[run_id][1]}."))
        st.caption(f"A step warns when {', or '.join(how)}. A warning holds where the reward then fell to half its "
                   "best or the warning is still on at the last step. A prompt to look, not a verdict: "
                   "docs/experiments.md counts how often each warning came before a collapse and how often it "
                   "was a false alarm.")


def count_of(n: float, total: float) -> str:
    """``"8.3% (1 of 12)"``: a fraction always with the counts it is made of."""
    return f"{n / total:.1%} ({int(n):,} of {int(total):,})" if total else "- (0 of 0)"


def rule_panel(rules: list[str], applied: str | None, key: str) -> None:
    """The parameter panel: one rule's parameters as widgets built from what the rule declares (a number input
    within each number's bounds, a choice among its choices), applied to every page of this session; the rule the
    run trained with stays at its own parameters on its run."""
    set_now = data.rule_params()
    label = "Rule parameters" + (f" ({len(set_now)} set)" if set_now else " (every rule at its defaults)")
    with st.expander(label, expanded=False, icon=":material/tune:"):
        rule = st.selectbox("Rule", rules, key=f"{key}_rule",
                            format_func=lambda r: r + figures.APPLIED_MARK if r == applied else r)
        spec = get_loss(rule)
        current = {**spec.defaults, **set_now.get(rule, {})}
        values = {}
        names = list(spec.mask_params) or list(spec.params)
        for col, name in zip(st.columns(max(1, len(names))), names, strict=True):
            param = spec.params[name]
            with col:
                if param.choices is not None:
                    options = sorted(param.choices)
                    values[name] = st.selectbox(name, options, index=options.index(current[name]),
                                                key=f"{key}_{rule}_{name}", help=f"one of {options}")
                else:
                    values[name] = st.number_input(
                        name, value=None if current[name] is None else float(current[name]),
                        min_value=None if param.low is None else float(param.low),
                        max_value=None if param.high is None else float(param.high), format="%g",
                        step=max(abs(float(spec.defaults[name] or 1.0)) / 10, 1e-6), key=f"{key}_{rule}_{name}",
                        help=f"bounds {param.bounds()}; default {spec.defaults[name]!r}")
        apply, reset = st.columns(2)
        if apply.button("Apply to every page", key=f"{key}_apply", icon=":material/check:"):
            try:
                params = validated(explicit_name(spec, {**spec.defaults, **values}), spec, values)
            except ValueError as err:
                st.error(str(err), icon=":material/error:")
            else:
                chosen = dict(st.session_state.get(data.RULE_PARAMS_KEY, {}))
                chosen[rule] = params
                st.session_state[data.RULE_PARAMS_KEY] = chosen
                st.rerun()
        if reset.button("Back to the defaults", key=f"{key}_reset", icon=":material/restart_alt:"):
            st.session_state[data.RULE_PARAMS_KEY] = {}
            st.rerun()
        shown = [explicit_name(get_loss(r), {**get_loss(r).defaults, **p}) for r, p in set_now.items()]
        st.caption(("Set here: " + ", ".join(shown) + ". " if shown else "")
                   + f"{rule}'s parameters and their bounds are declared with the rule (trustscope/losses.py); "
                   "the same settings as `--rule NAME:param=value` on the command line.")


def calibration_warnings(run_id: str, budget: pd.DataFrame) -> None:
    """A warning per rule whose parameters block more than half of the run's tokens with A != 0: out of
    calibration for this run, with the threshold that would block the same share as the equal budget's
    reference (``budget``: the run's rows of ``LogDB.equal_budget``)."""
    from trustscope.query.budget import OUT_OF_CALIBRATION

    totals = data.blocked_totals([run_id])
    over = totals[totals["blocked_frac"] > OUT_OF_CALIBRATION].sort_values("blocked_frac", ascending=False)
    for row in over.itertuples():
        match = budget[(budget["rule"] == row.rule) & budget["value"].notna()]
        hint = ""
        if len(match):
            m = match.iloc[0]
            hint = (f"; {m['param']} = {m['value']:.4g} would block the reference's share "
                    f"({count_of(m['n_blocked'], m['n_tokens'])}): `--rule {m['setting']}`")
        st.warning(f"**{row.rule}** blocks {count_of(row.n_blocked, row.n_tokens)} of this run's tokens with A != 0 "
                   f"at its parameters: out of calibration for this run{hint}.", icon=":material/tune:")
