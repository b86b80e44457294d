"""``trustscope explain``'s inferred shares against the trainer's measured ones, on toy runs that turn each known
cause of mismatch on alone and together (docs/experiments.md, "Explain: inferred against measured").

    .venv/bin/python -m studies.explain_measured --logdir runs/explain-measured [--engine vllm] [--steps 10]
        [--cases temperature,lag] [--json out.json]

Each case is one ``trustscope train`` run with ``explain_tokens`` on (:mod:`trustscope.train.attribution`: pi
recomputed with each cause removed, every combination, Shapley shares); then ``trustscope explain`` reads the logs
and puts its inferred share of each cause (the token indicators, :mod:`trustscope.explain`) beside the measured one,
over the whole run. The measured ``numerics`` (the engine's dtype) counts as the inferred ``unexplained``. Printed:
per case and cause the two shares and their difference; per case the mean absolute difference over the causes and
whether both name the same largest cause.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.7, "logprobs_mode": "raw_logprobs"},
    "top_p": {"top_p": 0.9},
    "top_p_masked": {"top_p": 0.9, "keep_sampling_mask": True},
    "top_k": {"top_k": 5},
    "lag": {"policy_lag": 2},
    "bf16": {"engine_dtype": "bfloat16"},
    "routing": {"model": "toy-moe-flip", "mini_batches": 4, "engine_dtype": "bfloat16"},
    "mixed": {"temperature": 0.7, "logprobs_mode": "raw_logprobs", "policy_lag": 2, "engine_dtype": "bfloat16"},
}
"""Case -> its settings over the defaults: one cause alone, the keep-sampling mask that removes one, all at once."""
COMPARED = ("temperature", "truncation", "staleness", "routing", "unexplained")


def run_case(name: str, logdir: Path, engine: str, steps: int, explain_tokens: int) -> None:
    from trustscope.train.config import TrainConfig
    from trustscope.train.loop import train

    if (logdir / name / "run.json").exists():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engines warn on the biased samplers these cases set on purpose
        train(TrainConfig(run_id=name, logdir=str(logdir), engine=engine, steps=steps, eval_every=0, save_every=0,
                          explain_tokens=explain_tokens, **CASES[name]))


def compare(logdir: Path, names: list[str]) -> list[dict[str, Any]]:
    from trustscope.explain.analysis import explain

    rows = []
    for r in explain(logdir, names, replicates=0).runs:
        inferred = {c.source: c.share for c in r.run.causes if c.measurable}
        measured = r.run.measured or {}
        for cause in COMPARED:
            if cause in inferred or cause in measured:
                rows.append({"case": r.run_id, "cause": cause, "inferred": inferred.get(cause),
                             "measured": measured.get(cause, 0.0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=Path("runs/explain-measured"))
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--explain-tokens", type=int, default=256)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; cases: {list(CASES)}")
    for name in names:
        run_case(name, args.logdir, args.engine, args.steps, args.explain_tokens)
    rows = compare(args.logdir, names)
    print(f"{'case':<14}{'cause':<13}{'inferred':>9}{'measured':>10}{'diff':>8}")
    for row in rows:
        inferred = "n/a" if row["inferred"] is None else f"{row['inferred']:.3f}"
        diff = "" if row["inferred"] is None else f"{row['inferred'] - row['measured']:+.3f}"
        if (row["inferred"] or 0) > 0.005 or row["measured"] > 0.005:
            print(f"{row['case']:<14}{row['cause']:<13}{inferred:>9}{row['measured']:>10.3f}{diff:>8}")
    print()
    for name in names:
        mine = [r for r in rows if r["case"] == name and r["inferred"] is not None]
        if not mine:
            continue
        error = sum(abs(r["inferred"] - r["measured"]) for r in mine) / len(mine)
        top_i = max(mine, key=lambda r: r["inferred"])["cause"]
        top_m = max(mine, key=lambda r: r["measured"])["cause"]
        print(f"{name:<14}mean |inferred - measured| {error:.3f} over {len(mine)} causes; largest: inferred {top_i}, "
              f"measured {top_m}{'' if top_i == top_m else '  (differ)'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
