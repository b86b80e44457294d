"""Time trustscope's verl pieces on verl's own actor loss path (CPU tensors, the model's forward left out).

    .venv/bin/python bench/bench_verl.py                 # B = 32 responses of T = 1024 tokens, micro-batches of 8

Per micro-batch, through verl 0.9.1's ``ppo_loss`` with forward and backward on pi:
  verl dppo_tv           verl's own DPPO-TV loss (the reference),
  trustscope dppo tv     loss_mode=trustscope_dppo_binary_tv (the rule, verl's agg_loss, the metrics),
  + actor hook           the same with ActorLogHook around ppo_loss: mu handed over, token rows queued for the
                         logger (its writer thread, the Parquet files and the per-step close included, since
                         each timed round is one step).
The model's forward and backward, which dominate a real step, are not in these figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from test_integration_verl import actor_config, make_batch, model_output  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from trustscope.integrations import verl as tv  # noqa: E402
from trustscope.logger import TokenLogger  # noqa: E402


def one_step(batch, pi, loss_fn, micro: int) -> float:
    """Seconds for one actor update over the whole batch (one mini-batch), loss and backward per micro-batch."""
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=len(td), use_dynamic_bsz=False, micro_batch_size_per_gpu=micro,
                         batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)
    micro_batches, _ = prepare_micro_batches(td)
    outputs = [model_output(mb, pi) for mb in micro_batches]  # built outside the timing, like the model's forward
    start = time.perf_counter()
    for mb, out in zip(micro_batches, outputs, strict=True):
        loss, _ = loss_fn(model_output=out, data=mb, dp_group=None)
        loss.backward(retain_graph=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    batch, pi = make_batch(B=args.batch, P=16, T=args.tokens, seed=0)
    pi.requires_grad_(True)
    with tempfile.TemporaryDirectory() as tmp:
        with TokenLogger(Path(tmp) / "drv", rank=0) as driver:
            tv.log_driver_batch(driver, batch, step=0)
        n_tokens = int(batch.batch["response_mask"].sum())
        cases = {
            "verl dppo_tv": partial(ppo_loss, config=actor_config("dppo_tv")),
            "trustscope dppo tv": partial(ppo_loss, config=actor_config("trustscope_dppo_binary_tv")),
        }
        hook = tv.ActorLogHook(cases["trustscope dppo tv"], Path(tmp) / "logs", "bench", loss_rule="dppo_binary_tv",
                               logger_options={"fsync": False})
        cases["+ actor hook"] = hook
        print(f"B={args.batch} T={args.tokens} micro={args.micro}: {n_tokens} valid tokens, median of {args.repeats}")
        print(f"{'case':<22}{'ms / step':>12}{'ms / micro-batch':>18}{'M tokens/s':>12}")
        times: dict[str, list[float]] = {name: [] for name in cases}
        for step in range(args.repeats):  # the cases interleaved, so a busy machine slows them alike
            batch.meta_info[tv.STEP_KEY] = step
            for name, fn in cases.items():
                times[name].append(one_step(batch, pi, fn, args.micro))
        for name, values in times.items():
            t = statistics.median(values)
            micro_batches = args.batch // args.micro
            print(f"{name:<22}{t * 1e3:>12.1f}{t * 1e3 / micro_batches:>18.2f}{n_tokens / t / 1e6:>12.2f}")


if __name__ == "__main__":
    main()
