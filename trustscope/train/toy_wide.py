"""The toy world at a real vocabulary: a toy world (dense ``toy-v2``, or the mixture-of-experts ``toy-moe``) widened to
V = 151,936, Qwen's vocabulary size.

The widened model keeps every trained row of its base (the 78 tokens of the character tokenizer) and adds a long
tail of 151,858 tokens the sampler can reach: their LM-head rows (the widened head is untied) are random around a direction the trained hidden states point away from, set so that the tail holds a set mean
probability mass per answer position (``tail_mass``, default 0.5%) on the task's held-out problems, spread over
its tokens with logits of standard deviation 2 (see :func:`widen`). Each tail token is a pseudo-subword of three or four
letters; the character tokenizer never produces one when encoding (it splits text into characters), so a tail
token enters a response only when the sampler draws it, as a rare token does in a real model, and it spoils that
response's reward. Everything that scales with V (the engine's sampler and log-probs, the trainer's LM head, the
log's top-K columns and vocabulary table, the dashboard's token views) runs at the real size, on a model that
still trains in seconds a step on a CPU.

The build starts from the base's cache entry (built, or copied from :mod:`trustscope.train.toy_models`), takes a
few seconds, and is cached under ``$TRUSTSCOPE_CACHE/toy/wide-<task>-<key>`` with a key hashing this
configuration, the base's key and the source of this module; nothing is downloaded.

    from trustscope.train.toy_wide import WIDE_PRESETS, build_wide_toy_model
    model_dir = build_wide_toy_model(WIDE_PRESETS["toy-v2-152k"])

``trustscope train --model toy-v2-152k --task addcol2`` trains it through vLLM like any toy world.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.toy_wide")

from trustscope.paths import cache_root
from trustscope.train import toy
from trustscope.train.builds import staged_build
from trustscope.train.tasks import get_task

WIDE_VERSION = "1"
"""Bumped when a change here changes the built model; the source of this module is hashed in as well."""

LETTERS = "abcdefghijklmnopqrstuvwxyz"

TAIL_SPREAD = 2.0
"""Standard deviation of the tail tokens' logits at a position, around their mean (which ``tail_mass`` sets)."""


@dataclass(frozen=True)
class WideToyConfig:
    """A base toy world and how it is widened; its hash (with the base's key and this module's source) is the key."""

    base: str = "toy-v2"
    """The toy world whose trained rows are kept: a dense one (:data:`trustscope.train.toy.TOY_PRESETS`) or a
    mixture-of-experts one (:data:`trustscope.train.toy_moe.MOE_PRESETS`: its routers and experts kept whole)."""
    task: str = "addcol2"
    """The task the base is warm-started on and the tail's mass is measured on (its eval split)."""
    vocab_size: int = 151_936
    """V of the widened model and tokenizer (Qwen2/Qwen3's 151,936 by default)."""
    tail_mass: float = 0.005
    """Mean probability mass of the tail tokens per answer position on the eval split, at temperature 1."""
    seed: int = 0
    """Seed of the tail's rows."""

    def __post_init__(self) -> None:
        if self.base not in base_presets():
            raise ValueError(f"base must be one of {', '.join(base_presets())}, got {self.base!r}")
        if not 0.0 < self.tail_mass < 0.5:
            raise ValueError(f"tail_mass must be in (0, 0.5), got {self.tail_mass}")
        base_vocab = len(toy.SPECIAL_TOKENS) + len(toy.CHARSET)
        if self.vocab_size <= base_vocab:
            raise ValueError(f"vocab_size must exceed the base's {base_vocab} tokens, got {self.vocab_size}")
        get_task(self.task)  # fails with the list of tasks

    def base_config(self) -> toy.ToyConfig:
        """The base toy world's configuration, warm-started on ``task``."""
        return dataclasses.replace(base_presets()[self.base], task=self.task)

    def key(self) -> str:
        """Cache key: a hash of the fields, the base's key, ``WIDE_VERSION`` and the source of this module."""
        blob = (json.dumps(dataclasses.asdict(self), sort_keys=True) + self.base_config().key() + WIDE_VERSION
                + Path(__file__).read_text())
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def base_presets() -> dict[str, toy.ToyConfig]:
    """The worlds a widening starts from: the dense presets and the mixture-of-experts ones."""
    from trustscope.train.toy_moe import MOE_PRESETS

    return {**toy.TOY_PRESETS, **MOE_PRESETS}


WIDE_PRESETS: dict[str, WideToyConfig] = {
    "toy-v2-152k": WideToyConfig(),
    "toy-moe-152k": WideToyConfig(base="toy-moe", task="add1"),
}
"""Named real-vocabulary toy worlds: ``toy-v2-152k``, ``toy-v2`` widened to V = 151,936 (20M parameters, 19.4M of
them the tail's rows); ``toy-moe-152k``, the mixture-of-experts ``toy-moe`` (two layers of four experts, top-2)
widened the same way, so routing is logged and replayed at the real vocabulary."""


def tail_texts(count: int) -> list[str]:
    """``count`` distinct pseudo-subwords of three or four letters (none a single character of the base)."""
    texts: list[str] = []
    n = 26**2  # skip the two-letter words: start at "baa"
    while len(texts) < count:
        word, i = "", n
        while i:
            i, r = divmod(i, 26)
            word = LETTERS[r] + word
        texts.append(word)
        n += 1
    return texts


def wide_tokenizer(vocab_size: int):
    """The character tokenizer with ``vocab_size - 78`` tail tokens after the base's ids (encoding is unchanged:
    text is still split into characters; a tail token decodes to its letters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = toy.SPECIAL_TOKENS + tuple(toy.CHARSET)
    vocab = {tok: i for i, tok in enumerate(base + tuple(tail_texts(vocab_size - len(base))))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=toy.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{toy.BOS} $A", pair=f"{toy.BOS} $A $B", special_tokens=[(toy.BOS, vocab[toy.BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=toy.BOS, eos_token=toy.EOS, pad_token=toy.PAD,
                                   unk_token=toy.UNK, model_max_length=128)


@torch.no_grad()
def answer_hidden(model: torch.nn.Module, tokenizer, problems: list, chunk: int = 64) -> torch.Tensor:
    """The final (normed) hidden states that predict each answer token and the EOS of ``problems``, ``(N, H)``."""
    rows = []
    for i in range(0, len(problems), chunk):
        input_ids, attention_mask, target_mask = toy.encode_problems(tokenizer, problems[i : i + chunk])
        out = model.model(input_ids=input_ids, attention_mask=attention_mask)
        rows.append(out.last_hidden_state[:, :-1][target_mask[:, 1:]])
    return torch.cat(rows)


def tail_mass(lse_base: torch.Tensor, lse_spread: torch.Tensor, along: torch.Tensor, depth: float) -> torch.Tensor:
    """Per position, the tail's softmax mass when its rows are ``depth * direction + spread``: its log-normaliser is
    ``depth * (h . direction) + lse_spread`` (the direction's part is the same for every tail token)."""
    return torch.sigmoid(depth * along + lse_spread - lse_base)


def calibrate_depth(lse_base: torch.Tensor, lse_spread: torch.Tensor, along: torch.Tensor, target: float) -> float:
    """The depth at which the tail's mean mass is ``target`` (bisection; the mass falls as the depth grows, the
    direction being one every position's hidden state points away from)."""
    lo, hi = 0.0, 1.0
    while float(tail_mass(lse_base, lse_spread, along, hi).mean()) > target:
        hi *= 2
        if hi > 1e6:
            raise RuntimeError(f"no depth brings the tail's mean mass down to tail_mass={target}")
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(tail_mass(lse_base, lse_spread, along, mid).mean()) > target:
            lo = mid
        else:
            hi = mid
    return hi


def widen(model: torch.nn.Module, tokenizer, config: WideToyConfig) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The base ``model`` with its vocabulary widened to ``config.vocab_size`` and its head untied: the base's rows
    kept in both; a tail token's input row is that of the letter its text starts with (the model reads it as that
    letter and goes on as it would, rather than from a random vector); its head row is ``depth * d + z``, where
    ``d`` is the direction every answer position's hidden state points away from (the least-squares ``h . d = -1`` over the eval split), ``z`` random rows giving the tail's logits at a position a
    spread of ``TAIL_SPREAD`` (their standard deviation), and ``depth`` the value that puts the tail's mean mass
    at ``config.tail_mass``. Returns the widened model and the calibration record."""
    if not model.config.tie_word_embeddings:
        raise ValueError("widen needs a base with tied embeddings (the toy worlds' default)")
    if toy.CHARSET[-len(LETTERS) * 2 :] != LETTERS + LETTERS.upper():
        raise ValueError("widen expects the character set to end with the letters a-z, A-Z")
    held_out = get_task(config.task).split("eval", config.base_config().seed)
    hidden = answer_hidden(model, tokenizer, held_out)  # (N, H)
    base_rows = model.get_input_embeddings().weight.detach().clone()  # (V0, H)
    v0, width = base_rows.shape
    direction = torch.linalg.lstsq(hidden, -torch.ones(len(hidden), 1)).solution[:, 0]  # (H,)
    gen = torch.Generator().manual_seed(config.seed)
    spread = torch.randn(config.vocab_size - v0, width, generator=gen)  # (V - V0, H)
    spread *= TAIL_SPREAD / float(hidden.norm(dim=-1).mean())
    with torch.no_grad():
        lse_base = (hidden @ base_rows.T).logsumexp(-1)  # (N,)
        lse_spread = torch.cat([(h @ spread.T).logsumexp(-1) for h in hidden.split(256)])  # (N,), 256 x V at a time
        along = hidden @ direction  # (N,)
    depth = calibrate_depth(lse_base, lse_spread, along, config.tail_mass)
    mass = tail_mass(lse_base, lse_spread, along, depth)
    first = v0 - len(LETTERS) * 2  # the id of "a"
    letters = [first + LETTERS.index(text[0]) for text in tail_texts(config.vocab_size - v0)]
    wide_config = model.config.__class__(**{**model.config.to_dict(), "vocab_size": config.vocab_size,
                                            "tie_word_embeddings": False})
    torch.manual_seed(config.seed)
    wide = type(model)(wide_config).float()
    state = {k: v for k, v in model.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    with torch.no_grad():
        state["model.embed_tokens.weight"] = torch.cat([base_rows, base_rows[letters]])
        state["lm_head.weight"] = torch.cat([base_rows, spread + depth * direction])
    wide.load_state_dict(state)
    wide.eval()
    return wide, {"depth": depth, "spread": TAIL_SPREAD, "mean_mass": float(mass.mean()),
                   "median_mass": float(mass.median()), "max_mass": float(mass.max()), "positions": len(mass)}


def build_wide_toy_model(config: WideToyConfig | None = None, *, cache_dir: str | Path | None = None,
                         force: bool = False, **overrides: Any) -> Path:
    """Build (or find in the cache) the widened toy world; return its directory (``save_pretrained`` layout with
    the tokenizer and ``trustscope_toy.json``, as :func:`trustscope.train.toy.build_toy_model` writes)."""
    from trustscope.train.toy_models import seed_cache

    config = dataclasses.replace(config or WideToyConfig(), **overrides)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "toy" / f"wide-{config.task}-{config.key()}"
    if (final / toy.META_FILE).exists() and not force:
        return final
    base_config = config.base_config()
    from trustscope.train.toy_moe import ToyMoeConfig, build_toy_moe_model

    if isinstance(base_config, ToyMoeConfig):
        base_dir = build_toy_moe_model(base_config, cache_dir=cache_dir)
    else:
        seed_cache(base_config, cache_dir)  # the shipped toy-v2, when the cache lacks it
        base_dir = toy.build_toy_model(base_config, cache_dir=cache_dir)
    with staged_build(final, force=force) as tmp:
        start = time.perf_counter()
        model, base_tokenizer = toy.load_toy_model(base_dir)
        model, record = widen(model, base_tokenizer, config)
        tokenizer = wide_tokenizer(config.vocab_size)
        held_out = get_task(config.task).split("eval", base_config.seed)
        model.eval()
        accuracy = get_task(config.task).accuracy(
            toy.solve_probabilities(model, tokenizer, held_out, chunk=8), held_out)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        base_meta = toy.toy_meta(base_dir)
        meta = {
            "config": dataclasses.asdict(config),
            "key": config.key(),
            "base": {"preset": config.base, "key": base_meta["key"], "parameters": base_meta["parameters"],
                     "warm_start": base_meta["warm_start"]},
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": config.vocab_size,
            "tail": record,
            "eval_expected_accuracy": accuracy,
            "build_seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / toy.META_FILE).write_text(json.dumps(meta, indent=2))
    return final
