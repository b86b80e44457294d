"""Where the mismatch lives: |pi - mu|, ESS and each rule's blocked fraction by staleness, turn and position; on
mixture-of-experts runs, |log pi/mu| and each rule's blocked fraction by routing agreement."""

import streamlit as st

from app import data, widgets
from trustscope import figures, report_where
from trustscope.columns import DIMENSIONS

st.title("Where the mismatch lives")
runs = widgets.require_runs()
ids = runs["run_id"].tolist()
first = widgets.pick_run(runs, "First run")  # the run picked on the other pages leads
remembered = st.session_state.get("_mismatch_runs")
others = [r for r in (remembered if remembered is not None else ids) if r in ids and r != first]
chosen = st.multiselect("Side by side", [r for r in ids if r != first], default=others[:3], key="mismatch_runs")
st.session_state["_mismatch_runs"] = chosen
picked = [first, *chosen]


def by_layer_table(exact, value: str, counts, key: str) -> None:
    """One row per run: its token count, then ``value`` overall and per MoE layer in layer order (the
    ``routing_agreement`` rows ``exact``), as percentages; runs without ``value`` left out."""
    rows = exact[exact["dimension"].isin(["all", "layer"]) & exact[value].notna()]
    order = rows.sort_values(["dimension", "bucket"], key=lambda c: c.map({"all": 0, "layer": 1}) if c.name ==
                             "dimension" else c)["label"].drop_duplicates().tolist()
    wide = rows.pivot_table(index="run_id", columns="label", values=value, aggfunc="first")[order]
    wide.insert(0, "tokens", counts.reindex(wide.index))
    st.dataframe(wide.reset_index(), hide_index=True, key=key, column_config={
        "tokens": st.column_config.NumberColumn("tokens", format="localized"),
        **{c: st.column_config.NumberColumn(c, format="percent") for c in wide.columns if c != "tokens"}})


def routing_section(picked: list[str], rules: list[str]) -> None:
    """By routing agreement: the tokens whose every (layer, slot) expert choice agrees between the engine and the
    trainer against the rest, by first disagreeing layer and by position, and the rules' blocked fractions."""
    st.header("By routing agreement")
    routing, routed_blocked, exact = data.by_routing(tuple(picked))
    absent = [r for r in picked if r not in set(routing["run_id"])]
    if absent:
        st.info(report_where.routing_absent_sentence(absent, data.routing_sides(tuple(absent))), icon=":material/info:")
    if routing.empty:
        return
    st.caption("Mixture-of-experts runs: a token agrees when every expert the engine routed it to (each MoE layer's "
               "top-k) is also the trainer's choice in that layer. A run trained with routing replay should show no "
               "disagreement at all (doctor check routing_replay).")
    counts = exact[exact["dimension"] == "all"].set_index("run_id")["n_tokens"]
    st.caption("Share of the engine's (layer, slot) expert choices the trainer also made, exact over every token "
               "handed to the logger (the summaries), overall and per MoE layer.")
    by_layer_table(exact, "agreement", counts, "routing_exact")
    if exact["replace_rate"].notna().any():
        st.caption("Routing replay's replace rate: the share of the trainer router's own (layer, slot) choices the "
                   "replay replaced by the engine's, exact over every token, overall and per MoE layer (prime-rl "
                   "logs the same as router_replay_replace_rate; the doctor's routing_replace_rate check warns when "
                   "it is high). Runs that log no router's own pick (router_experts) are not listed.")
        by_layer_table(exact, "replace_rate", counts, "routing_replaced")
    else:
        st.caption("No run here logs the trainer router's own pick under routing replay (router_experts), so no "
                   "replace rate: trustscope's trainer logs it with --routing-replay.")
    st.caption("|log pi/mu| over the token rows that carry both sides' experts (the rows token_fraction kept).")
    agree = routing[routing["split"] == "agreement"].copy()
    totals = agree.groupby("run_id")["n_tokens"].transform("sum")
    agree["tokens"] = [widgets.count_of(n, t) for n, t in zip(agree["n_tokens"], totals, strict=True)]
    st.dataframe(agree[["run_id", "label", "tokens", "mean_abs", "abs_share"]].rename(columns={"label": "routing"}),
                 hide_index=True, key="routing_agreement", column_config={
                     "mean_abs": st.column_config.NumberColumn("mean |log pi/mu|", format="%.4f"),
                     "abs_share": st.column_config.NumberColumn("share of total |log pi/mu|", format="percent")})
    widgets.chart(data.figure(figures.mismatch_by_routing, routing[routing["split"] == "first_layer"]),
                  "routing_first_layer", "No routed token here.")
    pos = routing[routing["split"] == "position"].copy()
    pos["disagree"] = [widgets.count_of(d, n) for d, n in zip(pos["n_disagree"], pos["n_tokens"], strict=True)]
    for column, count in (("mean_abs_full", pos["n_tokens"] - pos["n_disagree"]), ("mean_abs_disagree",
                                                                                  pos["n_disagree"])):
        pos[column] = ["no token" if not c or value != value else f"{value:.4f}"  # NaN: no token in the split
                       for value, c in zip(pos[column], count, strict=True)]
    st.dataframe(pos[["run_id", "label", "disagree", "mean_abs_full", "mean_abs_disagree"]].rename(
        columns={"label": "position", "mean_abs_full": "mean |log pi/mu|, full agreement",
                 "mean_abs_disagree": "mean |log pi/mu|, disagreement"}), hide_index=True, key="routing_position")
    shown = routed_blocked[routed_blocked["rule"].isin(rules)].copy()
    if shown.empty:
        st.caption("No rule picked above blocks a routed token with A != 0.")
        return
    shown["blocked"] = [widgets.count_of(b, n) for b, n in zip(shown["n_blocked"], shown["n_nonzero_advantage"],
                                                                strict=True)]
    wide = shown.pivot_table(index="rule", columns=["run_id", "agreement"], values="blocked", aggfunc="first")
    wide.columns = [f"{run}: {agreement}" for run, agreement in wide.columns]
    st.caption("Each rule's blocked share of the routed tokens with A != 0, by agreement.")
    st.dataframe(wide.reset_index(), hide_index=True, key="routing_blocked")

mismatch, blocked = data.by_dimension(tuple(picked))
st.caption("Exact over every token the trainer handed to the logger, every step taken together (the summaries' "
           "dimension rows: whatever token_fraction kept; a run logged in full without them, such as an import, from "
           "its token rows). ESS is the importance weights' effective sample size "
           "(sum w)^2 / sum w^2 over the bucket's tokens; a fraction always comes with its counts.")
if mismatch.empty:
    st.info(report_where.absent_sentence("position", picked) + " Runs logged with this version of trustscope's logger, "
            "or with every token kept, have position buckets; weight versions and turns need `policy_version` and "
            "`turn` per token.",
            icon=":material/info:")
    routing_section(picked, [r for r in [data.run_rule(first)] if r])  # token rows, whatever the summaries hold
    st.stop()
rules = widgets.pick_rules(sorted(set(blocked["rule"])), data.run_rule(first), key="mismatch_rules")
tabs = st.tabs([f"By {d.name}" for d in DIMENSIONS])
for tab, dim in zip(tabs, DIMENSIONS, strict=True):
    with tab:
        rows = mismatch[mismatch["dimension"] == dim.name]
        absent = report_where.lacking(mismatch, dim.name, picked)
        if absent:
            st.info(report_where.absent_sentence(dim.name, absent), icon=":material/info:")
        if rows.empty:
            continue
        st.caption(f"{dim.doc[0].upper()}{dim.doc[1:]}.")
        widgets.chart(data.figure(figures.mismatch_by_dimension, rows, dim.name), f"mismatch_{dim.name}",
                      f"No token has a {dim.name} here.")
        picked_blocked = blocked[(blocked["dimension"] == dim.name) & blocked["rule"].isin(rules)]
        widgets.chart(data.figure(figures.blocked_by_dimension, picked_blocked, dim.name), f"blocked_{dim.name}",
                      "No rule picked, or none blocks a token with A != 0 here: pick rules above.")
        table = rows[["run_id", "bucket", "bucket_label", "n_tokens", "mismatch_mean", "ess_frac",
                      "n_bad_negative"]].copy()
        table["bad negative"] = [widgets.count_of(b, n) for b, n in zip(table["n_bad_negative"], table["n_tokens"],
                                                                        strict=True)]
        for rule in rules:
            one = picked_blocked[picked_blocked["rule"] == rule].set_index(["run_id", "bucket"])
            table[rule] = [widgets.count_of(*one.loc[k, ["n_blocked", "n_nonzero_advantage"]]) if k in one.index
                           else "-" for k in zip(table["run_id"], table["bucket"], strict=True)]
        st.dataframe(table.drop(columns=["bucket", "n_bad_negative"]).rename(columns={"bucket_label": dim.name}),
                     hide_index=True, key=f"table_{dim.name}", column_config={
                         "n_tokens": st.column_config.NumberColumn("tokens", format="localized"),
                         "mismatch_mean": st.column_config.NumberColumn("mean |pi - mu|", format="%.4f"),
                         "ess_frac": st.column_config.NumberColumn("ESS / tokens", format="percent")})
routing_section(picked, rules)
