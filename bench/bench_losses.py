"""Cost of the trust-region divergences and of each loss rule, on CPU.

Run:  .venv/bin/python -m bench.bench_losses [--tokens 4096] [--vocab 32768 151936] [--loss-vocab 32768]
          [--k 20] [--repeat 5] [--threads 1]

Part 1, divergences: full-vocabulary TV (softmax of both policies' (N, V) logits) against top-K TV (K ids plus
'other') and binary TV, on N tokens. Time is the median of ``--repeat`` runs; memory is (a) the bytes of the
inputs each needs (the full version needs both policies' (N, V) logits, the others (N, K) or (N,)), and (b) the peak
resident-set growth while it runs (VmHWM after a reset through /proc/self/clear_refs; CPU tensors of a few hundred
kB stay in the allocator's pools, so small figures read as 0).

Part 2, losses: every rule's forward + backward against ``ppo_clip`` in the same process, with pi's logprobs
gathered from (N, V) logits that require grad (the top-K rules also gather pi at mu's K ids), then aggregated.
Reported twice: the whole step (log_softmax + gather + rule + aggregate + backward) and the rule alone on
precomputed logprobs (forward + backward), each as a ratio to ``ppo_clip``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch

from trustscope import divergence as D
from trustscope.losses import PolicyBatch, aggregate, get_loss

DPPO_RULES = ["dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl"]


def peak_rss_growth(fn: Callable[[], object]) -> int:
    """Bytes the resident set grew above its level at the call, at its peak while ``fn`` ran."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    out = fn()
    peak = _status_kb("VmHWM")
    del out
    return max(peak - before, 0) * 1024


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def median_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Run every fn once per round, in turn: median seconds and median per-round ratio to the first fn.

    Ratios taken within a round cancel most of the drift a machine shared with other work adds.
    """
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = next(iter(fns))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = {name: statistics.median(t / b for t, b in zip(ts, times[base], strict=True)) for name, ts in times.items()}
    return med, ratio


def full_vocab_tv(mu_logits: torch.Tensor, pi_logits: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """0.5 * sum_v |mu_v - pi_v| over the whole vocabulary, in float32, ``chunk`` tokens at a time."""
    out = []
    for i in range(0, mu_logits.shape[0], chunk):
        p = torch.softmax(mu_logits[i:i + chunk].float(), -1)  # (chunk, V)
        q = torch.softmax(pi_logits[i:i + chunk].float(), -1)  # (chunk, V)
        out.append(0.5 * (p - q).abs().sum(-1))
    return torch.cat(out)


def mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:9.1f}"


def bench_divergences(n: int, v: int, k: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    mu_logits = (3 * torch.randn(n, v, generator=g)).bfloat16()  # (N, V) what an engine would have to ship
    pi_logits = (mu_logits.float() + 0.1 * torch.randn(n, v, generator=g)).bfloat16()  # (N, V)
    a = torch.multinomial(torch.softmax(mu_logits[:64].float(), -1), 1).squeeze(-1).repeat(n // 64 + 1)[:n]  # (N,)
    mu_topk, pi_topk, mu_lp, pi_lp = [], [], [], []
    for i in range(0, n, 512):  # chunked: never two float32 (N, V) tensors at once
        mu_lsm = torch.log_softmax(mu_logits[i:i + 512].float(), -1)  # (chunk, V)
        pi_lsm = torch.log_softmax(pi_logits[i:i + 512].float(), -1)  # (chunk, V)
        top, ids = mu_lsm.topk(k, -1)  # (chunk, K)
        sampled = a[i:i + 512]
        ids, top = D.force_sampled_into_topk(ids, top, sampled, mu_lsm.gather(-1, sampled[:, None])[:, 0])
        mu_topk.append(top)
        pi_topk.append(pi_lsm.gather(-1, ids))
        mu_lp.append(mu_lsm.gather(-1, sampled[:, None])[:, 0])
        pi_lp.append(pi_lsm.gather(-1, sampled[:, None])[:, 0])
    mu_topk, pi_topk = torch.cat(mu_topk), torch.cat(pi_topk)  # (N, K)
    mu_lp, pi_lp = torch.cat(mu_lp), torch.cat(pi_lp)  # (N,)
    del mu_lsm, pi_lsm
    gc.collect()

    cases = {
        "full-vocab TV": (lambda: full_vocab_tv(mu_logits, pi_logits), 2 * n * v * 2),
        f"top-{k} TV": (lambda: D.topk_tv(mu_topk, pi_topk), 2 * n * k * 4),
        "binary TV": (lambda: D.binary_tv(mu_lp, pi_lp), 2 * n * 4),
    }
    base = None
    print(f"\nN={n} V={v} K={k}")
    print(f"{'divergence':<16}{'time ms':>10}{'x binary':>10}{'inputs MB':>11}{'peak RSS+ MB':>14}")
    rows = []
    for name, (fn, in_bytes) in cases.items():
        t = median_time(fn, repeat)
        rows.append((name, t, in_bytes, peak_rss_growth(fn)))
    base = rows[-1][1]
    figures = {}
    for name, t, in_bytes, peak in rows:
        print(f"{name:<16}{t * 1e3:10.3f}{t / base:10.1f}{mb(in_bytes):>11}{mb(peak):>14}")
        figures[name] = {"time_s": t, "x_binary": t / base, "inputs_mb": in_bytes / 2**20,
                         "peak_rss_growth_mb": peak / 2**20}
    return figures


def bench_losses(n: int, v: int, k: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(1)
    b, t = 16, n // 16
    logits = torch.randn(b, t, v, generator=g)  # (B, T, V)
    a = torch.randint(0, v, (b, t), generator=g)  # (B, T)
    ids = torch.randint(0, v, (b, t, k), generator=g)  # (B, T, K)
    ids[..., -1] = a
    with torch.no_grad():
        lsm = torch.log_softmax(logits, -1)
        mu_lp = lsm.gather(-1, a[..., None])[..., 0] + 0.05 * torch.randn(b, t, generator=g)  # (B, T)
        mu_topk = lsm.gather(-1, ids) + 0.05 * torch.randn(b, t, k, generator=g)  # (B, T, K)
        del lsm
    adv = torch.randn(b, t, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)

    def step(name: str) -> Callable[[], None]:
        rule = get_loss(name)
        topk = name.startswith("dppo_topk")

        def run() -> None:
            x = logits.detach().requires_grad_(True)
            lsm = torch.log_softmax(x, -1)  # (B, T, V)
            pi_lp = lsm.gather(-1, a[..., None])[..., 0]  # (B, T)
            pi_topk = lsm.gather(-1, ids) if topk else None  # (B, T, K)
            batch = PolicyBatch(pi_lp, mu_lp, adv, mask, mu_topk_logprobs=mu_topk if topk else None,
                                pi_topk_logprobs=pi_topk)
            aggregate(rule(batch).loss, mask).backward()

        return run

    with torch.no_grad():
        lsm = torch.log_softmax(logits, -1)
        pi_lp0 = lsm.gather(-1, a[..., None])[..., 0]
        pi_topk0 = lsm.gather(-1, ids)
        del lsm

    def rule_only(name: str) -> Callable[[], None]:
        rule = get_loss(name)
        topk = name.startswith("dppo_topk")

        def run() -> None:
            pi_lp = pi_lp0.detach().requires_grad_(True)
            batch = PolicyBatch(pi_lp, mu_lp, adv, mask, mu_topk_logprobs=mu_topk if topk else None,
                                pi_topk_logprobs=pi_topk0 if topk else None)
            aggregate(rule(batch).loss, mask).backward()

        return run

    print(f"\nloss rules, forward + backward, B={b} T={t} (N={n}) V={v} K={k}")
    print(f"{'rule':<16}{'step ms':>10}{'x ppo_clip':>12}{'rule ms':>10}{'x ppo_clip':>12}{'peak RSS+ MB':>14}")
    names = ["ppo_clip", *DPPO_RULES]
    whole, whole_x = interleaved({name: step(name) for name in names}, repeat)
    alone, alone_x = interleaved({name: rule_only(name) for name in names}, repeat * 4)
    figures = {}
    for name in names:
        peak = peak_rss_growth(step(name))
        print(f"{name:<16}{whole[name] * 1e3:10.1f}{whole_x[name]:12.3f}"
              f"{alone[name] * 1e3:10.2f}{alone_x[name]:12.2f}{mb(peak):>14}")
        figures[name] = {"step_s": whole[name], "step_x_ppo_clip": whole_x[name], "rule_s": alone[name],
                         "rule_x_ppo_clip": alone_x[name], "peak_rss_growth_mb": peak / 2**20}
    return figures


QUICK = ["--tokens", "1024", "--vocab", "32768", "--loss-vocab", "8192", "--repeat", "1"]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--loss-vocab", type=int, nargs="+", default=[32768],
                        help="vocabularies for part 2 (the (N, V) logits, their grad and log_softmax live at once)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; 1 keeps small ops off OpenMP barriers on a shared machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return {"divergences": {f"N={args.tokens} V={v}": bench_divergences(args.tokens, v, args.k, args.repeat)
                            for v in args.vocab},
            "losses": {f"N={args.tokens} V={v}": bench_losses(args.tokens, v, args.k, args.repeat)
                       for v in args.loss_vocab}}


if __name__ == "__main__":
    main()
