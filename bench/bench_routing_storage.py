"""Routed experts at production shapes: bytes a token on disk, the logger's CPU a step, and what waits on the caller.

    nice -n 10 .venv/bin/python -m bench.bench_routing_storage                      # 64 x 1,024 tokens a case
    nice -n 10 .venv/bin/python -m bench.bench_routing_storage --actor-tokens 2097152   # + the 2M-token step
    .venv/bin/python -m bench.bench_routing_storage --shapes qwen3 --json out.json
    .venv/bin/python -m bench.bench_routing_storage --shapes qwen3 dsv3 --cases base lists-both default-both
    .venv/bin/python -m bench.bench_routing_storage --shapes --actor-tokens 2097152   # the 2M-token step alone

One step of ``--responses`` x ``--length`` tokens, built like ``bench/bench_logger.py``'s (mu's top-20 over a 152k
vocabulary: the ~166 bytes a row the rest of a token takes), plus routing at each shape of :data:`SHAPES` (the toy
MoE world's, Qwen3-30B-A3B's, DeepSeek-V3's): the engine's experts k distinct ids a layer drawn uniformly (the
ids' entropy: what no encoding goes below), the trainer's the same with ``--agreement`` of the (layer, slot)
choices kept and the rest moved to other experts. Cases, each in a fresh process, per shape:

- ``base``: the step without routing (the row the routing is added to);
- ``lists-both`` / ``lists-engine``: both sides' expert lists (or the engine's alone) on every row
  (``routing_fraction=1``: the layout before the sampled lists, plus the per-token figures);
- ``default-both`` / ``default-engine``: the same at the default ``routing_fraction`` (the per-token figures on
  every row, the full lists on a share chosen by the shape, :func:`trustscope.logger.experts.default_fraction`).

Reported per case: bytes a token row of the ``tokens`` files and what routing adds over ``base`` (bytes and %);
the logger's CPU a step by thread (:class:`logger_cpu.LoggerCPU`: the caller inside ``log_step``, the writer
thread, the encoders) and what it adds over ``base``, scaled to a 2M-token step (linear in tokens).

``--actor-tokens N``: two more cases per shape of ``--actor-shapes``: a step of N tokens without routing (the
baseline), then the same step with both sides' lists (int16 numpy arrays, the caller's memory: ``log_step`` lends
them to the writer thread, :class:`trustscope.logger.experts.Lent`); the wall and CPU time of ``log_step`` alone
(the checks, what waits on the training thread), and of the step's whole write.
``--json`` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common

common.one_thread()

QUICK = ["--shapes", "toy", "--responses", "8", "--length", "256", "--cases", "base", "default-both"]
"""The small run: the toy shape, a 2,048-token step, the baseline and the default layout."""

SHAPES = {"toy": (4, 2, 16), "qwen3": (48, 8, 128), "dsv3": (58, 8, 256)}
"""(MoE layers, top-k, experts): the toy MoE world, Qwen3-30B-A3B, DeepSeek-V3."""

CASES = {"base": (None, None), "lists-both": (("engine", "trainer"), 1.0), "lists-engine": (("engine",), 1.0),
         "default-both": (("engine", "trainer"), None), "default-engine": (("engine",), None)}
STEP_TOKENS = 2_097_152


def routing(rng, n: int, shape: tuple[int, int, int], agreement: float) -> tuple:
    """``(engine, trainer)`` ``(n, L, k)`` int16: k distinct ids a layer; the trainer's keep ``agreement`` of the
    choices, the rest moved to an expert outside the layer's set."""
    import numpy as np

    layers, k, experts = shape
    engine = rng.integers(0, experts, (n, layers, k)).astype(np.int16)
    while True:  # redraw the slots that repeat an earlier slot of their layer
        s = np.sort(engine, -1)
        dup = (s[..., 1:] == s[..., :-1]).any(-1)  # (n, L)
        if not dup.any():
            break
        engine[dup] = rng.integers(0, experts, (int(dup.sum()), k))
    trainer = engine.copy()
    move = rng.random((n, layers, k)) >= agreement
    while move.any():
        trainer[move] = rng.integers(0, experts, int(move.sum()))
        clash = (trainer[..., :, None] == engine[..., None, :]).any(-1) & move  # landed on one of the engine's
        inner = (trainer[..., :, None] == trainer[..., None, :]).sum(-1) > 1
        move = clash | (inner & move)
    return engine, trainer


def child(case: str, shape_name: str, responses: int, length: int, agreement: float, out: Path) -> dict:
    """One case in this fresh process."""
    import numpy as np
    import torch

    import bench.bench_logger  # noqa: F401  (its imports before any timer)
    from bench.common import make_step
    from bench.logger_cpu import LoggerCPU
    from trustscope.logger import TokenLogger
    from trustscope.logger.experts import default_fraction

    torch.set_num_threads(1)
    shape = SHAPES[shape_name]
    sides, fraction = CASES[case]
    n = responses * length
    data = make_step(np.random.default_rng(0), responses, length, 20)
    if sides:
        engine, trainer = routing(np.random.default_rng(1), n, shape, agreement)
        data["engine_experts"] = engine.reshape(responses, length, *shape[:2])
        if "trainer" in sides:
            data["trainer_experts"] = trainer.reshape(responses, length, *shape[:2])
    samples = {"sample_id": np.arange(responses), "prompt_id": np.arange(responses) // 16}
    options = {"routing_shape": shape, "routing_fraction": fraction} if sides else {}
    with LoggerCPU() as cpu:
        logger = TokenLogger(out, "r", loss_rule="dppo_binary_tv", **options)
        t0 = time.perf_counter()
        logger.log_step(0, tokens=data, mask=np.ones((responses, length), bool), samples=samples)
        call = time.perf_counter() - t0
        logger.close()
        whole = time.perf_counter() - t0
    from bench.common import dir_bytes, token_rows

    rows = token_rows(out / "r" / "tokens")
    return {"case": case, "shape": shape_name, "routing_shape": shape, "tokens": n, "agreement": agreement,
            "routing_fraction": (fraction if fraction is not None else default_fraction(shape)) if sides else None,
            "bytes_per_row": dir_bytes(out / "r" / "tokens") / rows, "cpu_s": cpu.seconds(), "log_step_s": call,
            "write_s": whole, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def actor_child(shape_name: str, tokens: int, agreement: float, out: Path, routed: bool = True) -> dict:
    """A step of ``tokens`` tokens with both sides' lists (a block of distinct routing tiled; ``routed`` False: the
    same step without them, the baseline): ``log_step``'s wall and CPU, and the whole write's."""
    import numpy as np
    import torch

    from bench.logger_cpu import LoggerCPU
    from trustscope.logger import TokenLogger

    torch.set_num_threads(1)
    shape = SHAPES[shape_name]
    length = 4096
    responses = tokens // length
    block = 65536
    engine, trainer = routing(np.random.default_rng(1), block, shape, agreement)
    reps = -(-tokens // block)
    # Each tile's expert ids relabelled (+ the tile's index, mod experts): distinct routing in every response, so
    # the writer does not see one response's buffer reused by another (that would keep every row's lists).
    relabel = np.repeat(np.arange(reps, dtype=np.int16), block)[:tokens, None, None]  # (tokens, 1, 1)
    engine = ((np.tile(engine, (reps, 1, 1))[:tokens] + relabel) % shape[2]).reshape(responses, length, *shape[:2])
    trainer = ((np.tile(trainer, (reps, 1, 1))[:tokens] + relabel) % shape[2]).reshape(responses, length,
                                                                                      *shape[:2])
    rng = np.random.default_rng(0)
    mu = -rng.random((responses, length), dtype=np.float32)
    data = {"token_id": rng.integers(0, 151_936, (responses, length), dtype=np.int32), "mu_logprob": mu,
            "pi_logprob": mu, "advantage": np.repeat(rng.standard_normal(responses).astype(np.float32)[:, None],
                                                     length, 1),
            **({"engine_experts": engine, "trainer_experts": trainer} if routed else {})}
    samples = {"sample_id": np.arange(responses), "prompt_id": np.arange(responses) // 16}
    with LoggerCPU() as cpu:
        logger = TokenLogger(out, "r", loss_rule="dppo_binary_tv", max_buffered_rows=2 * tokens,
                             **({"routing_shape": shape} if routed else {}))
        c0, t0 = time.thread_time(), time.perf_counter()
        logger.log_step(0, tokens=data, mask=np.ones((responses, length), bool), samples=samples)
        call, call_cpu = time.perf_counter() - t0, time.thread_time() - c0
        logger.close()
        whole = time.perf_counter() - t0
    kept = None
    if routed:
        import pyarrow.parquet as pq

        files = sorted((out / "r" / "tokens").rglob("*.parquet"))
        kept = sum(pq.read_table(f, columns=["engine_experts"]).column(0).null_count for f in files)
        kept = 1.0 - kept / tokens  # the share of rows whose lists were written
    return {"case": "actor" if routed else "actor-base", "shape": shape_name, "tokens": tokens, "lists_kept": kept,
            "input_gib": (engine.nbytes * 2) / 2**30 if routed else 0.0,
            "log_step_s": call, "log_step_cpu_s": call_cpu, "write_s": whole, "cpu_s": cpu.seconds(),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_child(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([*common.module_cmd(__spec__), "--child", *args, "--out", tmp], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"case {args} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--agreement", type=float, default=0.95, help="share of (layer, slot) choices kept")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                        help="the cases run per shape (base, the baseline, always first)")
    parser.add_argument("--actor-tokens", type=int, default=0, help="also time log_step at a step this large")
    parser.add_argument("--actor-shapes", nargs="+", default=["qwen3"], choices=list(SHAPES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "actor":
            print(json.dumps(actor_child(args.child[1], int(args.child[2]), float(args.child[3]), args.out,
                                         routed=args.child[4] == "routed")))
        else:
            case, shape = args.child[:2]
            print(json.dumps(child(case, shape, args.responses, args.length, args.agreement, args.out)))
        return {}
    results = []
    figures: dict = {}
    common = ["--responses", str(args.responses), "--length", str(args.length), "--agreement", str(args.agreement)]
    print(f"{args.responses} x {args.length} tokens a step, {args.agreement:.0%} of (layer, slot) choices agree; "
          f"CPU scaled to a {STEP_TOKENS:,}-token step")
    print(f"{'shape':6} {'case':15} {'lists on':>8} {'B/row':>7} {'+B':>7} {'+%':>6} {'caller s':>9} "
          f"{'writer s':>9} {'encode s':>9} {'+CPU s':>7}")
    for shape in args.shapes:
        base = None
        for case in ["base", *(c for c in args.cases if c != "base")]:
            r = run_child([case, shape, *common])
            results.append(r)
            scale = STEP_TOKENS / r["tokens"]
            cpu = {k: v * scale for k, v in r["cpu_s"].items()}
            total = sum(cpu.values())
            if case == "base":
                base = (r["bytes_per_row"], total)
            added = r["bytes_per_row"] - base[0]
            share = "" if r["routing_fraction"] is None else f"{r['routing_fraction']:.3f}"
            print(f"{shape:6} {case:15} {share:>8} {r['bytes_per_row']:7.1f} {added:7.1f} "
                  f"{100 * added / base[0]:6.1f} {cpu['caller']:9.2f} {cpu['writer thread']:9.2f} "
                  f"{cpu['encoders']:9.2f} {total - base[1]:7.2f}")
            figures[f"{shape} {case}"] = {"bytes_per_row": r["bytes_per_row"], "added_bytes_per_row": added,
                                          "added_share": added / base[0], "cpu_s_a_step": cpu,
                                          "added_cpu_s_a_step": total - base[1]}
            if r["routing_fraction"] is not None:
                figures[f"{shape} {case}"]["routing_fraction"] = r["routing_fraction"]
    if args.actor_tokens:
        for shape in args.actor_shapes:
            for kind in ("base", "routed"):  # the same step without routing first: the baseline
                r = run_child(["actor", shape, str(args.actor_tokens), str(args.agreement), kind])
                results.append(r)
                what = "both sides' lists" if kind == "routed" else "no routing (baseline)"
                print(f"{shape}: a {r['tokens']:,}-token step with {what} ({r['input_gib']:.2f} GiB of lists): "
                      f"log_step {r['log_step_s']:.2f} s wall, {r['log_step_cpu_s']:.2f} s CPU on the caller; the "
                      f"whole write {r['write_s']:.1f} s (writer thread {r['cpu_s']['writer thread']:.1f} CPU s, "
                      f"encoders {r['cpu_s']['encoders']:.1f}); peak RSS {r['peak_rss_gib']:.1f} GiB"
                      + ("" if r["lists_kept"] is None else f"; lists kept on {r['lists_kept']:.1%} of the rows"))
                figures[f"{shape} actor {kind}"] = {
                    "tokens": r["tokens"], "input_gib": r["input_gib"], "log_step_s": r["log_step_s"],
                    "log_step_cpu_s": r["log_step_cpu_s"], "write_s": r["write_s"], "cpu_s": r["cpu_s"],
                    "peak_rss_gib": r["peak_rss_gib"]}
                if r["lists_kept"] is not None:
                    figures[f"{shape} actor {kind}"]["lists_kept"] = r["lists_kept"]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return figures


if __name__ == "__main__":
    main()
