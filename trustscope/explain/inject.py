"""Runs with known causes of mismatch injected, written through :class:`trustscope.logger.TokenLogger`: what the
explain tests and benchmark read back.

Every position gets trainer logits ``z`` over a vocabulary of ``V`` ids; pi is ``softmax(z)``. The engine's logits
are ``z`` plus a small numerics noise (``numerics``, in nats, the bf16-like floor every token carries), and each
injected cause changes the engine's side on the tokens it touches, as the real defect does:

- ``stale``: a share of the responses was sampled ``lag`` weight versions ago (``policy_version = step - lag``):
  the engine's logits carry a weight-change noise of ``cause_noise`` nats;
- ``routing``: a share of the tokens was routed to other experts by the engine (``routing_agreement`` < 1): the
  same noise on those tokens;
- ``drift``: a share of the responses was re-tokenized from the second turn on: ``engine_token_id`` differs at the
  turn's first token and the engine saw another history from there (the noise on every later token);
- ``temperature``: a share of the responses was sampled at ``temperature`` and the engine returned the processed
  log-probs while the trainer keeps temperature 1: ``mu = softmax(z / T)``;
- ``top_p``: a share of the responses was sampled from the nucleus of mass ``top_p``, the engine returning the
  renormalised log-probs: ``mu = softmax(z)`` restricted to the nucleus, divided by its mass;
- ``shift``: a share of the responses has mu logged one position late (``mu_logprob[t]`` is the engine's log-prob of
  token ``t - 1``), the top-K lists left in place.

The sampled token is drawn from mu, top-K lists are mu's ``K`` largest with pi at the same ids, and the trainer's
``kept`` is PPO's clip on pi / mu. Deterministic given the seed; numpy only (the logger's summaries use torch).

    python -m trustscope.explain.inject LOGDIR --cause stale=0.3 --cause routing=0.2
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CAUSES = ("stale", "routing", "drift", "temperature", "top_p", "shift")
"""The causes a run can be given, each with the share of responses (``routing``: of tokens) it touches."""


@dataclass(frozen=True)
class InjectConfig:
    """Shape of an injected-cause run.

    Attributes:
        causes: cause -> the share of responses it touches (``routing``: of tokens), each of :data:`CAUSES`.
        steps: training steps.
        responses: responses per step.
        length: tokens per response (two turns of ``length // 2``).
        vocab: vocabulary size V.
        k: top-K size.
        logit_scale: the standard deviation of the trainer's logits (sets the entropy: about 2.5 nats at 3).
        numerics: the engine's numerics noise on every logit (nats).
        cause_noise: the logit noise a stale, misrouted or re-tokenized token carries (nats).
        temperature: the engine's sampling temperature on the ``temperature`` responses.
        top_p: the nucleus mass on the ``top_p`` responses.
        lag: the policy lag of the ``stale`` responses.
        token_fraction: the logger's token_fraction (the summaries stay exact).
        seed: random seed.
        onset: the first step the causes touch (before it the run is clean): a run whose mismatch rises partway.
    """

    causes: Mapping[str, float] = field(default_factory=dict)
    steps: int = 8
    responses: int = 32
    length: int = 64
    vocab: int = 512
    k: int = 8
    logit_scale: float = 3.0
    numerics: float = 0.02
    cause_noise: float = 0.6
    temperature: float = 0.7
    top_p: float = 0.9
    lag: int = 2
    token_fraction: float = 1.0
    seed: int = 0
    onset: int = 0

    def __post_init__(self) -> None:
        for name, share in self.causes.items():
            if name not in CAUSES:
                raise ValueError(f"InjectConfig.causes: unknown cause {name!r}; known: {list(CAUSES)}")
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"InjectConfig.causes[{name!r}]={share!r} must be a share in [0, 1]")
        if self.length < 4 or self.length % 2:
            raise ValueError(f"InjectConfig.length={self.length} must be an even number >= 4 (two turns)")
        if not 1 <= self.k <= self.vocab:
            raise ValueError(f"InjectConfig.k={self.k} must be in [1, vocab={self.vocab}]")
        if isinstance(self.onset, bool) or not isinstance(self.onset, int) or self.onset < 0:
            raise ValueError(f"InjectConfig.onset={self.onset!r} must be a whole step number >= 0")


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _nucleus(logp: np.ndarray, top_p: float) -> np.ndarray:
    """``logp`` ``(..., V)`` restricted to the smallest set of ids whose mass reaches ``top_p``, renormalised
    (-inf outside), as vLLM's top-p sampler does."""
    order = np.argsort(-logp, axis=-1)
    sorted_p = np.exp(np.take_along_axis(logp, order, axis=-1))
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass above each id
    keep_sorted = before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    mass = np.where(keep, np.exp(logp), 0.0).sum(axis=-1, keepdims=True)
    return np.where(keep, logp - np.log(mass), -np.inf)


def _step_tokens(rng: np.random.Generator, cfg: InjectConfig, step: int) -> dict[str, np.ndarray]:
    """One step's token columns ``(B, T)`` / ``(B, T, K)`` with the causes injected."""
    b, t, v = cfg.responses, cfg.length, cfg.vocab
    z = rng.standard_normal((b, t, v)) * cfg.logit_scale  # (B, T, V) the trainer's logits
    log_pi = _log_softmax(z)
    z_engine = z + rng.standard_normal((b, t, v)) * cfg.numerics
    share = dict(cfg.causes) if step >= cfg.onset else {}  # the same draws either way: only the shares change

    def responses(name: str) -> np.ndarray:  # (B,) the responses a cause touches
        return rng.uniform(size=b) < share.get(name, 0.0)

    lag = np.where(responses("stale"), min(cfg.lag, step), 0)  # (B,)
    routing = (rng.uniform(size=(b, t)) < share.get("routing", 0.0))  # (B, T)
    drifted = responses("drift")  # (B,)
    half = t // 2
    after_drift = drifted[:, None] & (np.arange(t)[None, :] >= half)  # (B, T) the second turn of a drifted response
    noisy = (lag[:, None] > 0) | routing | after_drift  # (B, T)
    z_engine = z_engine + noisy[..., None] * rng.standard_normal((b, t, v)) * cfg.cause_noise
    log_mu = _log_softmax(z_engine)
    tempered = responses("temperature")
    log_mu[tempered] = _log_softmax(z_engine[tempered] / cfg.temperature)
    truncated = responses("top_p")
    log_mu[truncated] = _nucleus(log_mu[truncated], cfg.top_p)

    token = np.argmax(log_mu + rng.gumbel(size=log_mu.shape), axis=-1)  # (B, T) sampled from mu
    mu_lp = np.take_along_axis(log_mu, token[..., None], axis=-1)[..., 0]
    pi_lp = np.take_along_axis(log_pi, token[..., None], axis=-1)[..., 0]
    shifted = responses("shift")
    mu_lp[shifted, 1:] = mu_lp[shifted, :-1].copy()  # mu logged one position late
    ids = np.argsort(-log_mu, axis=-1)[..., : cfg.k]  # (B, T, K) mu's top-K
    mu_topk = np.maximum(np.take_along_axis(log_mu, ids, axis=-1), -80.0)
    pi_topk = np.take_along_axis(log_pi, ids, axis=-1)
    missing = (ids != token[..., None]).all(axis=-1)  # the sampled token outside mu's top-K: put it last
    ids[missing, -1] = token[missing]
    mu_topk[missing, -1] = np.maximum(np.take_along_axis(log_mu, token[..., None], axis=-1)[..., 0][missing], -80.0)
    pi_topk[missing, -1] = pi_lp[missing]

    engine_token = token.copy()
    engine_token[drifted, half] = (token[drifted, half] + 1) % v  # the engine sampled another id there
    advantage = np.repeat(rng.choice([-0.5, 0.5], size=b)[:, None], t, axis=1)  # (B, T)
    ratio = np.exp(pi_lp - mu_lp)
    return {
        "token_id": token, "mu_logprob": mu_lp.astype(np.float32), "pi_logprob": pi_lp.astype(np.float32),
        "advantage": advantage.astype(np.float32), "kept": np.abs(ratio - 1.0) <= 0.2,
        "mu_topk_ids": ids, "mu_topk_logprobs": mu_topk.astype(np.float32),
        "pi_topk_logprobs": pi_topk.astype(np.float32),
        "policy_version": np.repeat((step - lag)[:, None], t, axis=1),
        "turn": np.repeat((np.arange(t) >= half)[None, :].astype(np.int32), b, axis=0),
        "engine_token_id": engine_token,
        "routing_agreement": np.where(routing, 0.75, 1.0).astype(np.float32),
    }


def write_run(logdir: Path | str, run_id: str, config: InjectConfig | None = None,
              drop: tuple[str, ...] = (), flush_steps: bool = False, **logger_options: Any) -> Path:
    """Write one injected-cause run to ``<logdir>/<run_id>/``; ``drop`` leaves those token columns out (a run that
    does not log them); ``flush_steps``: one flush a step (the logger's files then hold one step each);
    ``logger_options`` go to the TokenLogger. Returns the run directory."""
    from trustscope.logger import TokenLogger

    cfg = config or InjectConfig()
    rng = np.random.default_rng(cfg.seed)
    sampling = {"temperature": 1.0, "top_p": 1.0}
    with TokenLogger(logdir, run_id, vocab=[f"t{i}" for i in range(cfg.vocab)], loss_rule="ppo_clip",
                     config={"inject": dict(cfg.causes), "steps": cfg.steps}, sampling=sampling,
                     token_fraction=cfg.token_fraction, seed=cfg.seed, **{"fsync": False, **logger_options}) as logger:
        for step in range(cfg.steps):
            cols = {k: v for k, v in _step_tokens(rng, cfg, step).items() if k not in drop}
            ids = step * cfg.responses + np.arange(cfg.responses)
            logger.log_step(step, tokens=cols, samples={"sample_id": ids, "prompt_id": ids // 4})
            if flush_steps:
                logger.flush()
    return Path(logdir) / run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir")
    parser.add_argument("--run-id", default="injected")
    parser.add_argument("--cause", action="append", default=[], metavar="NAME=SHARE",
                        help=f"a cause and its share, repeatable; causes: {', '.join(CAUSES)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--responses", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    causes = {}
    for item in args.cause:
        name, _, share = item.partition("=")
        causes[name] = float(share or 1.0)
    cfg = InjectConfig(causes=causes, steps=args.steps, responses=args.responses, length=args.length, seed=args.seed)
    print(write_run(args.logdir, args.run_id, cfg))


if __name__ == "__main__":
    main()
