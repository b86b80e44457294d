"""Time what trustscope's verl pieces add on the actor's thread, against the same step without them and against
a real architecture's forward and backward on the same shapes.

    .venv/bin/python -m bench.bench_verl                 # B = 32 responses of T = 1024 tokens, micro-batches of 8
    .venv/bin/python -m bench.bench_verl --batch 8 --tokens 2048 --micro 2 --model   # 4,096-token micro-batches,
                                                         # and a Qwen3-shaped model's forward + backward on them

Per step (one actor update over the batch), through verl 0.9.1's ``ppo_loss`` with forward and backward on pi:
  verl dppo_tv           verl's own DPPO-TV loss (the reference: the step without trustscope),
  trustscope dppo tv     loss_mode=trustscope_dppo_binary_tv called as verl calls it without the hook (the rule,
                         verl's agg_loss, the rule's own statistics as actor/trustscope/...),
  + actor hook           the rule under ActorLogHook, as attach runs it: mu handed over, the rule's statistics
                         left to the logger, the token rows handed to the rank's logger (one for the whole run)
                         and the step committed with commit_step(); its writer thread (Arrow, Parquet, fsync, the
                         manifest) runs beside the actor and shares the machine's cores with it.
``--model``: a Qwen3ForCausalLM (transformers' own architecture: GQA attention with q/k RMSNorm, RoPE, SwiGLU)
built from a reduced config (hidden 256, 2 layers, 4 heads / 2 KV heads, MLP 768, vocab 32,768: a real Qwen3's
vocab of 151,936 would not fit a 4k-token backward in this machine's memory) is timed on one micro-batch of the
same shape, forward and backward, and the hook's added time per micro-batch is printed as a share of it. A larger
model only makes that share smaller.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from bench.verl_batches import actor_config, make_batch, model_output
from trustscope.integrations import verl as tv
from trustscope.logger import TokenLogger


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


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", action="store_true", help="time a Qwen3-shaped model's forward + backward too")
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
        hook = tv.ActorLogHook(cases["trustscope dppo tv"], Path(tmp) / "logs", "bench", loss_rule="dppo_binary_tv")
        cases["+ actor hook"] = hook
        print(f"B={args.batch} T={args.tokens} micro={args.micro}: {n_tokens} valid tokens, median of {args.repeats}")
        print(f"{'case':<22}{'ms / step':>12}{'ms / micro-batch':>18}{'M tokens/s':>12}")
        times: dict[str, list[float]] = {name: [] for name in cases}
        for step in range(args.repeats):  # the cases interleaved, so a busy machine slows them alike
            batch.meta_info[tv.STEP_KEY] = step
            for name, fn in cases.items():
                times[name].append(one_step(batch, pi, fn, args.micro))
        micro_batches = args.batch // args.micro
        figures: dict = {"valid_tokens": n_tokens}
        for name, values in times.items():
            t = statistics.median(values)
            print(f"{name:<22}{t * 1e3:>12.1f}{t * 1e3 / micro_batches:>18.2f}{n_tokens / t / 1e6:>12.2f}")
            figures[name] = {"step_s": t, "micro_batch_s": t / micro_batches, "tokens_per_s": n_tokens / t}
        hook.close()
        added = (statistics.median(times["+ actor hook"]) - statistics.median(times["verl dppo_tv"])) / micro_batches
        print(f"added on the actor's thread by the rule and the hook: {added * 1e3:.2f} ms per micro-batch")
        figures["added_s_per_micro_batch"] = added
        if args.model:
            fb = model_forward_backward(args.micro, args.tokens + 16, max(3, args.repeats // 3))
            print(f"Qwen3-shaped model, forward + backward of one micro-batch ({args.micro} x {args.tokens + 16} "
                  f"tokens): {fb * 1e3:.0f} ms; the rule and the hook add {100 * added / fb:.2f} % of it")
            figures["model_forward_backward_s"] = fb
            figures["added_share_of_model"] = added / fb
        return figures


def model_forward_backward(batch: int, length: int, repeats: int) -> float:
    """Median seconds of a reduced Qwen3ForCausalLM's forward (with the token log-probs verl's actor takes from
    the logits) and backward on ``batch`` sequences of ``length`` tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32768, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, length))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1]  # (B, L - 1, V)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L - 1)
        logp.mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        del logits, logp
    return statistics.median(times)


if __name__ == "__main__":
    main()
