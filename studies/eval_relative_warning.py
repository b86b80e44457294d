"""The collapse warning's lines on runs of other mismatch scales: absolute (``WarningLines()``) against the run's
own baseline (``WarningLines(relative_z=...)``), on synthetic runs at 0.1x, 1x and 10x the synthetic toy's
mu -> pi_old mismatch, each quiet (pi stays at pi_old) and collapsing (pi drifts from pi_old, more every step).

    .venv/bin/python -m studies.eval_relative_warning [--steps 40] [--tokens 20000] [--window 10] [--z 6]

Prints, per run and line set, the warning steps, the first one, and which line fired (docs/experiments.md,
"Warnings relative to the run").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

from trustscope import report  # noqa: E402
from trustscope.db import connect  # noqa: E402
from trustscope.synthetic import SyntheticConfig, generate_run  # noqa: E402

SCALES = (0.1, 1.0, 10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--z", type=float, default=6.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="relative-warning-"))
    for scale in SCALES:
        for name, drift in (("quiet", 0.0), ("collapsing", 3.0)):
            generate_run(root, f"{name}-x{scale:g}", SyntheticConfig(
                tokens=args.tokens, steps=args.steps, edge_cases=False, loss_rule="pg_is", mismatch=0.03 * scale,
                drift=drift, seed=int(scale * 10)))
    rows = []
    with connect(root, cache=False) as db:
        runs = sorted(db.overview().steps["run_id"].unique())
        for label, lines in (("absolute (default lines + detector)", report.WarningLines(window=args.window)),
                             (f"relative, {args.z:g} robust deviations",
                              report.WarningLines(window=args.window, relative_z=args.z))):
            got = report.collapse_warnings(db, runs, lines)
            for run_id, part in got.groupby("run_id"):
                warned = part[part["warning"]]
                rows.append({"lines": label, "run": run_id, "warning steps": len(warned),
                             "first": int(warned["step"].min()) if len(warned) else None,
                             "bad-rate line": int(part["warn_bad_rate"].sum()),
                             "mismatch line": int(part["warn_mismatch"].sum()),
                             "detector": int(part["warn_score"].sum())})
    pd.set_option("display.width", 200)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
