"""Realistic synthetic token logs, for tests and benchmarks, in exactly the layout a real run writes.

Every response token gets a rollout distribution mu over its top-K ids plus an 'other' bucket, a sampled token drawn
from it (forced into the top-K set when it falls outside, as the engines do), pi_old from mu with a small
training-inference mismatch that grows as probability shrinks, and pi from pi_old with an update that grows with
the step. Advantages are GRPO's (binary reward minus the group mean, not divided by the std), so groups whose
responses all agree give A = 0. ``topk_tv`` / ``topk_kl`` come from :mod:`trustscope.divergence` and ``kept`` from the
run's rule in :mod:`trustscope.losses`, exactly as the trainer's capture computes them.

Optionally the first step of a run carries hand-made edge cases: A = 0, ratios and divergences sitting exactly on
every rule's default threshold, probabilities near 0 and near 1, mu exactly at the low-probability relaxation's
alpha. Everything is vectorised numpy and written through :class:`trustscope.logger.TokenLogger`, so the files
are a real run's; 10M tokens took about 15 minutes on the 2-core machine while it was shared (load average ~10),
most of it the top-K divergences in torch and the logger's checks and Parquet writing. Time grows linearly.

Usage::

    python -m trustscope.synthetic LOGDIR --tokens 10_000_000 --runs 1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.synthetic")

from trustscope import divergence as D
from trustscope.losses import PolicyBatch, get_loss

REASONING_WORDS = ("Wait", "Thus", "However", "So", "Therefore", "Hmm", "Let", "Alternatively", "But", "Check")
"""High-entropy words the paper finds among the clipped low-probability tokens."""
MATH_SYMBOLS = ("=", "+", "-", "*", "/", "(", ")", "^", "<", ">", "\\frac", "\\sqrt", "\\boxed", "{", "}")
COMMON_WORDS = (
    "the", "a", "of", "to", "is", "and", "we", "that", "in", "it", "answer", "number", "sum", "value", "first",
    "then", "step", "find", "each", "total", "are", "for", "this", "with", "which", "so", "be", "have", "get",
    "can", "now", "two", "three", "one", "times", "equal", "result", "gives", "from", "by",
)


def make_vocab(vocab_size: int = 4096) -> list[str]:
    """Token texts: reasoning words, digits, numbers, math symbols, common words, then filler sub-words."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size={vocab_size} must be >= 256")
    texts = [*REASONING_WORDS, *(str(d) for d in range(10)), *MATH_SYMBOLS, " ", ".", ",", "\n", *COMMON_WORDS]
    texts += [str(n) for n in range(10, 100)]
    texts += [f"tok{i}" for i in range(vocab_size - len(texts))]
    return texts[:vocab_size]


N_HARD = len(REASONING_WORDS) + 10 + len(MATH_SYMBOLS)
"""Ids ``[0, N_HARD)`` are the reasoning words, digits and math symbols that low-probability tokens favour."""


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape and behaviour of a synthetic run.

    Attributes:
        tokens: total response tokens in the run (approximately: whole responses are generated).
        steps: RL steps the tokens are spread over.
        group_size: responses per prompt (G); advantages are reward minus the group mean.
        mean_length: mean response length in tokens (lengths are geometric-like, at least 1).
        k: top-K size of the logged lists.
        vocab_size: size of the vocabulary table.
        ranks: trainer ranks; each writes its own files.
        loss_rule: registered rule whose mask fills ``kept``.
        loss_params: the rule's parameters (recorded in run.json's config, as the trainer does).
        mismatch: scale of the mu -> pi_old training-inference mismatch (log space).
        drift: scale of the pi_old -> pi update at the last step (log space; grows linearly with the step).
        rows_per_file: token rows per Parquet file (a real logger flushes at a similar size).
        edge_cases: put the hand-made threshold cases into step 0.
        summaries: the logger's exact summaries and per-token ``blocked_rules`` bits (``TokenLogger(summaries=)``).
        rule_settings: rule settings the summaries also count (``TokenLogger(rule_settings=)``).
        seed: random seed.
    """

    tokens: int = 50_000
    steps: int = 10
    group_size: int = 8
    mean_length: int = 64
    k: int = 20
    vocab_size: int = 4096
    ranks: int = 1
    loss_rule: str = "dppo_binary_tv"
    loss_params: dict = field(default_factory=dict)
    mismatch: float = 0.03
    drift: float = 0.25
    rows_per_file: int = 1 << 20
    edge_cases: bool = True
    summaries: bool = True
    rule_settings: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "steps", "group_size", "mean_length", "k", "ranks", "rows_per_file"):
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticConfig.{name}={getattr(self, name)!r} must be >= 1")
        if self.k > self.vocab_size // 4:
            raise ValueError(f"SyntheticConfig.k={self.k} is too large for vocab_size={self.vocab_size}")
        get_loss(self.loss_rule).resolve(**self.loss_params)  # fails with the list of valid names / parameters


# ------------------------------------------------------------------------------------------------ distributions


def _topk_distribution(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """mu's top-K probabilities ``(n, K)`` sorted descending and the 'other' bucket ``(n,)``.

    A per-token sharpness mixes peaked positions (a head token near 1) with flat, high-entropy ones.
    """
    sharp = rng.gamma(1.5, 1.6, size=(n, 1)).astype(np.float32)  # (n, 1)
    logits = -sharp * np.arange(k, dtype=np.float32) ** 0.7 + rng.normal(0, 0.3, size=(n, k)).astype(np.float32)
    logits = -np.sort(-logits, axis=1)
    rest_logit = (logits[:, -1:] + np.log(rng.uniform(2, 200, size=(n, 1)))).astype(np.float32)
    full = np.concatenate([logits, rest_logit], axis=1)  # (n, K+1)
    full = np.exp(full - full.max(axis=1, keepdims=True))
    full /= full.sum(axis=1, keepdims=True)
    return full[:, :k], full[:, k]


def _perturb(rng: np.random.Generator, p: np.ndarray, rest: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A nearby distribution over the same K ids + other: log-space noise, bigger on small probabilities.

    ``p`` ``(n, K)``, ``rest`` ``(n,)``, ``scale`` ``(n, 1)``. Returns ``(n, K+1)``, rows summing to 1.
    """
    full = np.concatenate([p, rest[:, None]], axis=1)  # (n, K+1)
    logp = np.log(np.maximum(full, 1e-30))
    tail = 1.0 + 0.6 * np.clip(-logp, 0, 12) ** 0.5
    heavy = rng.standard_t(4, size=full.shape).astype(np.float32)
    logq = logp + scale * tail * heavy
    q = np.exp(logq - logq.max(axis=1, keepdims=True))
    return q / q.sum(axis=1, keepdims=True)


def _sample_index(rng: np.random.Generator, p: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Index sampled from mu over K ids + other; K means 'outside the top-K'. ``(n,)``."""
    cdf = np.cumsum(np.concatenate([p, rest[:, None]], axis=1), axis=1)
    u = rng.uniform(0, 1, size=(p.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((u > cdf).sum(axis=1), p.shape[1])


@dataclass
class _Tokens:
    """Per-token arrays of one chunk (N tokens)."""

    token_id: np.ndarray  # (N,) int32
    mu_lp: np.ndarray  # (N,) float32
    old_lp: np.ndarray  # (N,) float32
    pi_lp: np.ndarray  # (N,) float32
    entropy: np.ndarray  # (N,) float32
    topk_ids: np.ndarray  # (N, K) int32
    mu_topk: np.ndarray  # (N, K) float32
    pi_topk: np.ndarray  # (N, K) float32


def _random_tokens(rng: np.random.Generator, n: int, cfg: SyntheticConfig, progress: float) -> _Tokens:
    """``n`` tokens drawn as the module docstring describes; ``progress`` in [0, 1] scales the update."""
    k = cfg.k
    p, rest = _topk_distribution(rng, n, k)
    idx = _sample_index(rng, p, rest)  # (n,)
    outside = idx == k
    # A sampled token outside the top-K takes the K-th slot with its own (smaller) probability.
    own = p[:, -1] * rng.uniform(0.05, 1.0, size=n).astype(np.float32)
    rest = np.where(outside, rest + p[:, -1] - own, rest)
    p[:, -1] = np.where(outside, own, p[:, -1])
    idx = np.where(outside, k - 1, idx)
    mismatch = (cfg.mismatch * rng.lognormal(0, 0.5, size=(n, 1))).astype(np.float32)
    old_full = _perturb(rng, p, rest, mismatch)
    update = (cfg.drift * (0.2 + progress) * rng.lognormal(0, 0.7, size=(n, 1))).astype(np.float32)
    pi_full = _perturb(rng, old_full[:, :k], old_full[:, k], update)
    rows = np.arange(n)
    # Ids: low-probability samples favour reasoning words, digits and symbols.
    mu_s = p[rows, idx]
    hard = rng.uniform(size=n) < np.where(mu_s < 0.15, 0.6, 0.08)
    zipf = np.minimum(rng.zipf(1.3, size=n) + N_HARD - 1, cfg.vocab_size - 1)
    sampled = np.where(hard, rng.integers(0, N_HARD, size=n), zipf).astype(np.int64)
    stride = 7 if cfg.vocab_size % 7 else 11
    offsets = (np.arange(k)[None, :] - idx[:, None]) % k  # (n, K): 0 at the sampled slot
    topk_ids = ((sampled[:, None] + offsets * stride) % cfg.vocab_size).astype(np.int32)
    full = np.concatenate([p, rest[:, None]], axis=1)
    entropy = -(full * np.log(np.maximum(full, 1e-30))).sum(axis=1)
    mu_topk = np.log(np.maximum(p, 1e-30)).astype(np.float32)
    pi_topk = np.log(np.maximum(pi_full[:, :k], 1e-30)).astype(np.float32)
    return _Tokens(
        token_id=sampled.astype(np.int32),
        mu_lp=mu_topk[rows, idx],
        old_lp=np.log(np.maximum(old_full[rows, idx], 1e-30)).astype(np.float32),
        pi_lp=pi_topk[rows, idx],
        entropy=entropy.astype(np.float32),
        topk_ids=topk_ids,
        mu_topk=mu_topk,
        pi_topk=pi_topk,
    )


# ------------------------------------------------------------------------------------------------ edge cases


def edge_probabilities() -> list[tuple[float, float]]:
    """``(mu, pi)`` pairs of the sampled token that sit on or next to every rule's default threshold."""
    from trustscope import losses as L

    pairs = [(0.5, 0.5), (1.0, 1.0), (1.0, 0.5), (0.999999, 0.9), (1e-9, 1e-9), (1e-9, 1e-3), (1e-6, 0.2)]
    for eps in (L.EPS_LOW, L.EPS_HIGH):
        for mu in (0.01, 0.3, 0.6):
            pairs += [(mu, mu * (1 + eps)), (mu, mu * (1 - eps))]
    for delta in (L.DELTA_TV, 0.5):
        for mu in (0.2, 0.55, 0.7):
            pairs += [(mu, mu + delta), (mu, mu - delta)]
    pairs += [(0.1, 0.05), (0.1, 0.2), (0.0999, 0.05), (0.0999, 0.2), (0.25, 0.75), (0.75, 0.25), (0.99, 0.8)]
    return [(mu, pi) for mu, pi in pairs if 0 < pi <= 1 and 0 < mu <= 1]


EDGE_ADVANTAGES = (1.0, 0.0, -1.0, 0.5, -0.5)


def _edge_tokens(cfg: SyntheticConfig) -> tuple[_Tokens, np.ndarray]:
    """Edge-case tokens: every ``(mu, pi)`` pair of :func:`edge_probabilities` under every advantage sign.

    The sampled token sits at slot 0; the other K-1 ids share the remaining mass geometrically, with the same shape
    under mu and pi, and an 'other' bucket of 10%. Returns the tokens and their advantages.
    """
    pairs = edge_probabilities()
    k = cfg.k
    mu = np.array([m for m, _ in pairs] * len(EDGE_ADVANTAGES), dtype=np.float64)
    pi = np.array([q for _, q in pairs] * len(EDGE_ADVANTAGES), dtype=np.float64)
    adv = np.repeat(np.array(EDGE_ADVANTAGES, dtype=np.float32), len(pairs))
    n = mu.size
    shape = 0.5 ** np.arange(1, k)
    shape = shape / shape.sum()

    def lists(p: np.ndarray) -> np.ndarray:
        others = (1 - p)[:, None] * 0.9 * shape[None, :]
        return np.log(np.maximum(np.concatenate([p[:, None], others], axis=1), 1e-30)).astype(np.float32)

    mu_topk, pi_topk = lists(mu), lists(pi)
    ids = ((np.arange(n)[:, None] + 7 * np.arange(k)[None, :]) % cfg.vocab_size).astype(np.int32)
    mu_lp = np.log(mu).astype(np.float32)
    pi_lp = np.log(pi).astype(np.float32)
    tokens = _Tokens(
        token_id=ids[:, 0], mu_lp=mu_lp, old_lp=mu_lp.copy(), pi_lp=pi_lp,
        entropy=np.full(n, 1.0, dtype=np.float32), topk_ids=ids, mu_topk=mu_topk, pi_topk=pi_topk,
    )
    return tokens, adv


# ------------------------------------------------------------------------------------------------ writing


def _keep_and_topk(t: _Tokens, adv: np.ndarray, rule: str,
                   params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``kept`` from the run's rule and ``topk_tv`` / ``topk_kl`` from :mod:`trustscope.divergence`."""
    mu_topk, pi_topk = torch.from_numpy(t.mu_topk), torch.from_numpy(t.pi_topk)  # (N, K)
    tv = D.topk_tv(mu_topk, pi_topk).numpy()
    kl = D.topk_kl(mu_topk, pi_topk).numpy()
    batch = PolicyBatch(
        pi_logprob=torch.from_numpy(t.pi_lp)[None],  # (1, N)
        mu_logprob=torch.from_numpy(t.mu_lp)[None],
        advantages=torch.from_numpy(adv)[None],
        mask=torch.ones(1, t.mu_lp.size, dtype=torch.bool),
        old_logprob=torch.from_numpy(t.old_lp)[None],
        mu_topk_logprobs=mu_topk[None],
        pi_topk_logprobs=pi_topk[None],
    )
    keep = get_loss(rule)(batch, **params).keep[0].numpy()
    return keep, tv.astype(np.float32), kl.astype(np.float32)


def generate_run(logdir: Path | str, run_id: str = "synthetic", config: SyntheticConfig | None = None) -> Path:
    """Write one synthetic run to ``<logdir>/<run_id>/`` through :class:`trustscope.logger.TokenLogger` (one
    logger per rank), so files, names, row groups and the manifest are exactly a real run's. Returns the run
    directory."""
    from trustscope.logger import TokenLogger

    cfg = config or SyntheticConfig()
    rng = np.random.default_rng(cfg.seed)
    vocab = make_vocab(cfg.vocab_size)
    texts = np.array(vocab, dtype=object)
    manifest = {"config": {**cfg.__dict__}, "model": {"name": "synthetic"}, "tokenizer": {"name": "synthetic"},
                "sampling": {"topk": cfg.k, "temperature": 1.0}}
    loggers = [
        TokenLogger(logdir, run_id, **manifest, vocab=vocab if rank == 0 else None, loss_rule=cfg.loss_rule,
                    rank=rank, flush_rows=cfg.rows_per_file, flush_seconds=1e9, fsync=False,
                    summaries=cfg.summaries, rule_settings=cfg.rule_settings)
        for rank in range(cfg.ranks)
    ]
    try:
        tokens_per_step = max(1, cfg.tokens // cfg.steps)
        for step in range(cfg.steps):
            _log_step(loggers, rng, cfg, step, tokens_per_step, texts)
    except BaseException:
        for logger in loggers:
            logger.close(status="crashed")
        raise
    for logger in loggers:
        logger.close()
    return Path(logdir) / run_id


def _log_step(loggers: list, rng: np.random.Generator, cfg: SyntheticConfig, step: int, tokens_per_step: int,
              texts: np.ndarray) -> None:
    """Generate one step's responses and log them, rank by rank, in chunks of whole responses."""
    progress = step / max(1, cfg.steps - 1)
    n_samples = max(cfg.group_size, round(tokens_per_step / cfg.mean_length / cfg.group_size) * cfg.group_size)
    lengths = np.maximum(1, rng.geometric(1 / cfg.mean_length, size=n_samples)).astype(np.int64)
    lengths = np.maximum(1, np.round(lengths * tokens_per_step / lengths.sum())).astype(np.int64)
    prompt_id = step * 100_000 + np.arange(n_samples) // cfg.group_size
    solve_rate = rng.beta(1.2, 1.2, size=n_samples // cfg.group_size).repeat(cfg.group_size)
    reward = (rng.uniform(size=n_samples) < solve_rate).astype(np.float32)
    group_mean = reward.reshape(-1, cfg.group_size).mean(axis=1).repeat(cfg.group_size)
    sample_adv = (reward - group_mean).astype(np.float32)
    sample_rank = (np.arange(n_samples) * cfg.ranks // n_samples).astype(np.int32)
    finish = np.where(rng.uniform(size=n_samples) < 0.9, "stop", "length").astype(object)
    sample_of_token = np.repeat(np.arange(n_samples), lengths)
    for lo, hi in _chunk_bounds(np.cumsum(lengths), cfg.rows_per_file):
        s_all = sample_of_token[lo:hi]
        for rank, logger in enumerate(loggers):
            s = s_all[sample_rank[s_all] == rank]
            if s.size == 0:
                continue
            t = _random_tokens(rng, s.size, cfg, progress)
            adv = sample_adv[s]
            keep, tv, kl = _keep_and_topk(t, adv, cfg.loss_rule, cfg.loss_params)
            ids = np.unique(s)
            _log_chunk(logger, step, s, ids, t, adv, keep, tv, kl, texts, {
                "prompt_id": prompt_id[ids], "reward": reward[ids], "advantage": sample_adv[ids],
                "finish_reason": list(finish[ids]),
                "prompt": [f"What is {p % 97} + {p % 89}?" for p in prompt_id[ids]],
            })
    if cfg.edge_cases and step == 0:
        t, adv = _edge_tokens(cfg)
        per = len(edge_probabilities())
        s = n_samples + np.arange(adv.size) // per
        keep, tv, kl = _keep_and_topk(t, adv, cfg.loss_rule, cfg.loss_params)
        ids = np.unique(s)
        _log_chunk(loggers[0], step, s, ids, t, adv, keep, tv, kl, texts, {
            "prompt_id": np.full(ids.size, -1), "reward": np.zeros(ids.size, np.float32),
            "advantage": np.array(EDGE_ADVANTAGES, np.float32), "finish_reason": ["length"] * ids.size,
            "prompt": ["<edge cases>"] * ids.size,
        })
    r = float(reward.mean())
    loggers[0].log_step(step, scalars={"reward": r, "accuracy": r, "loss": float(rng.normal(0, 0.05)), "lr": 1e-6,
                                       "grad_norm": float(rng.lognormal(0, 0.3)),
                                       "time/step_s": float(rng.uniform(5, 7))})


def _log_chunk(logger, step: int, s: np.ndarray, ids: np.ndarray, t: _Tokens, adv: np.ndarray, keep: np.ndarray,
               tv: np.ndarray, kl: np.ndarray, texts: np.ndarray, samples: dict) -> None:
    """Log tokens of whole responses (rows grouped by sample ``s``, in order) in the logger's ragged form."""
    cuts = np.flatnonzero(np.diff(s)) + 1

    def ragged(values: np.ndarray) -> list[np.ndarray]:
        return np.split(values, cuts)

    token_texts = ragged(texts[t.token_id])
    logger.log_step(
        step,
        tokens={
            "token_id": ragged(t.token_id), "mu_logprob": ragged(t.mu_lp), "old_logprob": ragged(t.old_lp),
            "pi_logprob": ragged(t.pi_lp), "advantage": ragged(adv), "entropy": ragged(t.entropy),
            "mu_topk_ids": ragged(t.topk_ids), "mu_topk_logprobs": ragged(t.mu_topk),
            "pi_topk_logprobs": ragged(t.pi_topk), "topk_tv": ragged(tv), "topk_kl": ragged(kl),
            "kept": ragged(keep),
        },
        samples={"sample_id": ids, "response": ["".join(x[:400]) for x in token_texts], **samples},
    )


def _chunk_bounds(ends: np.ndarray, rows_per_file: int) -> list[tuple[int, int]]:
    """Token-row ranges of whole samples, each about ``rows_per_file`` rows. ``ends``: cumulative lengths."""
    bounds, lo = [], 0
    total = int(ends[-1])
    while lo < total:
        hi = int(ends[min(np.searchsorted(ends, lo + rows_per_file, side="left"), ends.size - 1)])
        hi = max(hi, lo + 1)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def generate_logdir(logdir: Path | str, runs: int = 1, config: SyntheticConfig | None = None,
                    rules: tuple[str, ...] = ("dppo_binary_tv", "grpo", "pg_is")) -> Path:
    """Write ``runs`` synthetic runs ``run0..`` (each with its own seed and a rule from ``rules``) under ``logdir``."""
    cfg = config or SyntheticConfig()
    for i in range(runs):
        run_cfg = SyntheticConfig(**{**cfg.__dict__, "seed": cfg.seed + i, "loss_rule": rules[i % len(rules)]})
        generate_run(logdir, f"run{i}", run_cfg)
    return Path(logdir)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write synthetic trustscope logs.")
    parser.add_argument("logdir")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens per run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = SyntheticConfig(tokens=args.tokens, steps=args.steps, k=args.k, ranks=args.ranks, seed=args.seed)
    print(generate_logdir(args.logdir, args.runs, cfg))


if __name__ == "__main__":
    main()
