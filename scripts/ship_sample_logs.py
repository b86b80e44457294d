"""Regenerate ``sample_logs/``: eight runs of preset ``sanity-climb-stale``, thinned, named, compacted and checked.

    .venv/bin/python scripts/ship_sample_logs.py [--staging runs/sample-logs-staging] [--dest sample_logs]
                                                 [--no-train]

How it was run (2026-12-04, two busy CPU cores, about 20 min): ``.venv/bin/python scripts/ship_sample_logs.py``.

Steps, each repeatable:

1. Train :data:`RULES` x :data:`SEEDS` with ``studies/experiments.py run --preset sanity-climb-stale --no-probe
   --seeds 0 1 --rules pg_is ppo_clip dppo_binary_tv grpo --set log_token_fraction=0.05`` into the staging folder,
   one process; runs already finished there are skipped (``--no-train`` ships what staging holds).
2. Copy them next to the destination and normalise each ``run.json`` (:func:`normalise`): the model is named by its
   world, ``toy-v2-warm``, with ``model.path`` ``toy/<the shipped build's folder>`` (as the old runs named
   ``toy-v2``), the log directory is the preset's (``runs/sanity-climb-stale``), and no string names a path of
   this machine.
3. Compact them with trustscope's own compaction (one file per table and run), drop empty folders (git ships
   none), then run ``trustscope validate`` and ``trustscope doctor`` on the copy; either failing leaves
   ``sample_logs/`` as it was.
4. Swap the copy in for ``sample_logs/`` in one atomic exchange of the two folders (``renameat2``), then remove
   the old runs (they stay in git history; ``tests/data/legacy`` keeps one).

The runs log 5% of their tokens (``log_token_fraction=0.05``): 2.7-2.8 MB a run, 1.7 MB of it token rows and
1.0 MB the summaries, which do not shrink with the fraction (22 MB in all, against 11.6 MB for the eight 100-step
toy-v2 runs of layout 1 they replaced). The token fraction decides which tokens are written, never what is
trained: checked on 2026-12-04 against the preset's sweep logged at 0.25 (``runs/sanity-climb-stale``,
docs/experiments.md), the eight shipped runs have ``steps`` tables equal to it at every step in every scalar but
the timings (``time/*``, ``throughput/*``), rewards included (seven checked scalar by scalar, ``sanity-grpo-s1``'s
reward per step), so the shipped runs are that sweep's runs, thinner.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESET = "sanity-climb-stale"
RULES = ("pg_is", "ppo_clip", "dppo_binary_tv", "grpo")
"""PG-IS (no trust region, collapses and recovers), then the clip and the mask, then GRPO's symmetric clip."""
SEEDS = (0, 1)
WORLD = "toy-v2-warm"
TOKEN_FRACTION = 0.05
SHIPPED_LOGDIR = f"runs/{PRESET}"


def run_ids() -> list[str]:
    return [f"sanity-{rule}-s{seed}" for seed in SEEDS for rule in RULES]


def train(staging: Path) -> None:
    """Train every shipped run not yet finished in ``staging``, in one process (experiments.py skips the rest)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "experiments.py"), "run", "--preset", PRESET, "--no-probe",
           "--seeds", *map(str, SEEDS), "--rules", *RULES, "--logdir", str(staging),
           "--set", f"log_token_fraction={TOKEN_FRACTION}"]
    subprocess.run(cmd, check=True, cwd=ROOT)


def world_build() -> str:
    """``toy/<folder>`` of the shipped build of :data:`WORLD` (the cache entry the runs were trained on)."""
    from trustscope.train.toy_models import entry_name
    from trustscope.train.toy_warm import warm_config

    return f"toy/{entry_name(warm_config(WORLD))}"


def _machine_paths(value, where: str = "") -> list[str]:
    """Every string of a parsed run.json that names an absolute path (``where`` is its key path)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _machine_paths(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _machine_paths(v, f"{where}[{i}]")]
    return [f"{where}: {value}"] if isinstance(value, str) and value.startswith(("/", "~")) else []


def normalise(run_dir: Path, build: str) -> None:
    """Name the model by its world and the log directory by the preset's in ``run_dir/run.json``; refuse one that
    still names a path of this machine, or is not a finished run of the expected token fraction."""
    path = run_dir / "run.json"
    m = json.loads(path.read_text())
    if m.get("status") != "finished":
        raise SystemExit(f"{run_dir}: status {m.get('status')!r}, not finished")
    if m["logging"]["token_fraction"] != TOKEN_FRACTION:
        raise SystemExit(f"{run_dir}: logged at token fraction {m['logging']['token_fraction']}, "
                         f"not {TOKEN_FRACTION}")
    trained_on = m["model"]["path"].rstrip("/").rpartition("/")[2]
    if trained_on != build.rpartition("/")[2]:
        raise SystemExit(f"{run_dir}: trained on {m['model']['path']}, not the shipped build {build}")
    m["config"].update(model=WORLD, logdir=SHIPPED_LOGDIR)
    m["model"].update(name=WORLD, path=build)
    m["tokenizer"]["name"] = build
    m["sampling"]["model_dir"] = build
    m["publishing"] = []  # the last flush's files, in place (runs written before the logger cleared them at close)
    left = _machine_paths(m)
    if left:
        raise SystemExit(f"{run_dir}/run.json still names paths of this machine: {left}")
    path.write_text(json.dumps(m, indent=1) + "\n")


def check(folder: Path) -> None:
    """``trustscope validate`` and ``trustscope doctor`` on ``folder``; exits naming the one that failed."""
    from typer.testing import CliRunner

    from trustscope.cli import app

    for verb in ("validate", "doctor"):
        result = CliRunner().invoke(app, [verb, str(folder)])
        print(result.output.strip().splitlines()[-1] if result.output.strip() else f"{verb}: no output")
        if result.exit_code != 0:
            raise SystemExit(f"trustscope {verb} {folder} exited {result.exit_code}; sample_logs left as it was:\n"
                             f"{result.output}")


def ship(staging: Path, dest: Path) -> None:
    from trustscope.runformat.fsops import exchange
    from trustscope.runformat.maintenance import compact_logdir

    build = world_build()
    new = dest.with_name(dest.name + ".new")
    if new.exists():
        shutil.rmtree(new)
    new.mkdir()
    for rid in run_ids():
        src = staging / rid
        if not (src / "run.json").is_file():
            raise SystemExit(f"{src}: missing; train it first (drop --no-train)")
        shutil.copytree(src, new / rid, ignore=shutil.ignore_patterns("*.lock", ".*"))
        normalise(new / rid, build)
    for r in compact_logdir(new, grace_s=0):
        print(f"{Path(r.run_dir).name}: {r.files_before} -> {r.files_after} files")
    for leftover in new.glob("*/_superseded"):
        shutil.rmtree(leftover)
    for folder in sorted((p for p in new.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):  # git keeps no empty folder (ranks/ of a one-rank run): check what ships
            folder.rmdir()
    check(new)
    if dest.exists():
        exchange(new, dest)  # dest is the new runs now, new the old ones
        shutil.rmtree(new)
    else:
        new.rename(dest)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"{dest}: {len(run_ids())} runs, {size / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staging", type=Path, default=ROOT / "runs" / "sample-logs-staging")
    parser.add_argument("--dest", type=Path, default=ROOT / "sample_logs")
    parser.add_argument("--no-train", action="store_true", help="ship what the staging folder holds")
    args = parser.parse_args()
    if not args.no_train:
        train(args.staging)
    ship(args.staging, args.dest)


if __name__ == "__main__":
    main()
