"""The toy world's model: a tiny Qwen2 with a character tokenizer, built locally and warm-started on a task.

``build_toy_model()`` returns a directory that both vLLM and transformers load (``save_pretrained`` layout). The
build trains the model with a short supervised warm start until it solves about ``target_accuracy`` of the task's
held-out problems when sampled at temperature 1, which leaves RL room to improve. Builds are cached by a hash of
the configuration and of this code under ``$TRUSTSCOPE_CACHE/toy`` (default ``~/.cache/trustscope/toy``); a build
is written to a temporary directory and renamed into place, so concurrent builders never see half a model.

Expected accuracy is computed exactly rather than sampled: the character tokenizer spells every answer one way and
the reward is strict, so the probability that a temperature-1 sample scores 1 is the probability of the answer's
tokens followed by EOS, one teacher-forced forward pass.

    from trustscope.train.toy import build_toy_model
    model_dir = build_toy_model()                 # cached; about 20-30 s the first time on 2 busy CPU cores
    model_dir = build_toy_model(task="add2", target_accuracy=0.3)
    model_dir = build_toy_model(TOY_PRESETS["toy-v2"])  # the larger toy world: worked column addition

Presets (``TOY_PRESETS``): ``toy``, the default (437k parameters, one-digit addition, answers of 1-2 tokens);
``toy-v2``, a deeper model (3 layers, 650k parameters) warm-started on ``addcol2``, whose responses are 15-26
tokens of worked column addition: long enough for per-token mismatch to add up over a response, which the
default is not; ``toy-gpu``, for a GPU machine (see ``scripts/gpu_sanity.sh``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trustscope.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a reader's install: the [train] extra brings torch
    missing(exc, "trustscope.train.toy")

from trustscope.paths import cache_root
from trustscope.train.tasks import Problem, get_task

"""Environment variable overriding the cache root (default ``~/.cache/trustscope``)."""

TOY_VERSION = "1"
"""Bumped when a change here changes the built model; the source of this module is hashed in as well."""

META_FILE = "trustscope_toy.json"
"""Written into every built model directory: the configuration, the cache key and the warm-start results."""

PAD, EOS, BOS, UNK = "<|pad|>", "<|eos|>", "<|bos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
CHARSET = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""One token per character. Ids: the four special tokens first (pad 0, eos 1, bos 2, unk 3), then CHARSET."""


@dataclass(frozen=True)
class ToyConfig:
    """Everything that defines a toy model; its hash (with this module's source) is the cache key."""

    task: str = "add1"
    """Task the warm start trains on (its train split) and measures accuracy on (its eval split). The default,
    one-digit addition, reaches the target in seconds; "arith" (one- and two-digit, mixed) needs ~10x longer."""
    target_accuracy: float = 0.5
    """Stop the warm start once the expected temperature-1 accuracy on the eval split reaches this."""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    """head_dim = hidden_size / num_attention_heads must be 32 or 64 (vLLM's CPU attention kernels)."""
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 128
    batch_size: int = 64
    lr: float = 3e-3
    max_steps: int = 3000
    """Upper bound on warm-start steps; the build fails if the target is not reached by then."""
    eval_every: int = 25
    seed: int = 0
    num_threads: int = 1
    """torch threads while building (one thread is steadier on a shared 2-core machine). Not part of the key."""
    device: str = "cpu"
    """Where the warm start runs (``cpu`` or ``cuda``, for the GPU preset). Not part of the key."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target_accuracy < 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1), got {self.target_accuracy}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim not in (32, 64):
            raise ValueError(f"head_dim = hidden_size / num_attention_heads must be 32 or 64 for vLLM, got {head_dim}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for name in ("intermediate_size", "num_hidden_layers", "batch_size", "max_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        get_task(self.task)  # fails with the list of tasks

    def key(self) -> str:
        """Cache key: a hash of the fields, ``TOY_VERSION`` and the source of this module."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("num_threads", "device")}
        blob = json.dumps(fields, sort_keys=True) + TOY_VERSION + Path(__file__).read_text()
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TOY_PRESETS: dict[str, ToyConfig] = {
    "toy": ToyConfig(),
    "toy-v2": ToyConfig(task="addcol2", target_accuracy=0.3, num_hidden_layers=3, max_steps=4000),
    "toy-gpu": ToyConfig(task="addcol3", target_accuracy=0.35, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=6, num_attention_heads=8, batch_size=256, lr=1e-3, max_steps=6000,
                         device="cuda"),
}
"""Named toy worlds. ``toy-gpu`` (20M parameters, three-digit column addition, warm-started on the GPU) is the
model of ``scripts/gpu_sanity.sh``. The column-addition presets' target is the probability of the canonical worked
solution, a lower bound of the temperature-1 reward (:func:`trustscope.train.tasks.column_addition_reward` also
accepts other valid workings)."""


def toy_tokenizer():
    """The character tokenizer (a ``PreTrainedTokenizerFast``): BOS prepended, one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARSET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=128
    )


def new_toy_model(config: ToyConfig, tokenizer) -> torch.nn.Module:
    """A randomly initialised Qwen2ForCausalLM for ``config`` (float32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    torch.manual_seed(config.seed)
    return Qwen2ForCausalLM(cfg).float()


def encode_problems(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch for ``prompt + answer + EOS``, right-padded.

    Returns ``input_ids`` (B, L) long, ``attention_mask`` (B, L) long, and ``target_mask`` (B, L) bool, True where
    the token is part of the answer or the EOS (the positions the model must predict).
    """
    prompt_ids = tokenizer([p.prompt for p in problems])["input_ids"]
    answer_ids = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    rows = [q + a + [tokenizer.eos_token_id] for q, a in zip(prompt_ids, answer_ids, strict=True)]
    starts = [len(q) for q in prompt_ids]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, L)
    target_mask = torch.zeros((len(rows), length), dtype=torch.bool)  # (B, L)
    for i, (r, s) in enumerate(zip(rows, starts, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention_mask[i, : len(r)] = 1
        target_mask[i, s : len(r)] = True
    return input_ids, attention_mask, target_mask


def answer_logprobs(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Log-probability of each problem's ``answer + EOS`` given its prompt, ``(B,)``; differentiable."""
    input_ids, attention_mask, target_mask = (t.to(model.device) for t in batch)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, L-1, V)
    token_lp = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]  # (B, L-1)
    return (token_lp * target_mask[:, 1:]).sum(-1)


@torch.no_grad()
def solve_probabilities(model: torch.nn.Module, tokenizer, problems: list[Problem], chunk: int = 1024) -> list[float]:
    """Per problem, the probability that a temperature-1 sample is exactly the answer followed by EOS.

    This is the expected reward of :func:`trustscope.train.tasks.exact_number_reward` (the character tokenizer
    spells each answer one way)."""
    was_training = model.training
    model.eval()
    probs: list[float] = []
    for i in range(0, len(problems), chunk):
        probs += answer_logprobs(model, encode_problems(tokenizer, problems[i : i + chunk])).exp().tolist()
    model.train(was_training)
    return probs


def expected_accuracy(model: torch.nn.Module, tokenizer, problems: list[Problem], task: str | None = None) -> float:
    """Expected temperature-1 accuracy on ``problems``; with ``task`` a mixture, components count equally."""
    probs = solve_probabilities(model, tokenizer, problems)
    if task is None:
        return sum(probs) / len(probs)
    return get_task(task).accuracy(probs, problems)


def warm_start(model: torch.nn.Module, tokenizer, config: ToyConfig) -> dict[str, Any]:
    """Supervised training on the task's train split until the eval split's expected accuracy reaches the target.

    Returns the warm-start record (steps, accuracy, per-task accuracy, loss). Raises ``RuntimeError`` when
    ``max_steps`` pass without reaching the target."""
    task = get_task(config.task)
    train, held_out = task.split("train", config.seed), task.split("eval", config.seed)
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = 50
    accuracy, loss_value, step = 0.0, math.nan, 0
    model.train()
    for step in range(1, config.max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, step / warmup)
        batch = encode_problems(tokenizer, [train[rng.randrange(len(train))] for _ in range(config.batch_size)])
        loss = -answer_logprobs(model, batch).sum() / batch[2].sum().to(model.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        if step % config.eval_every == 0:
            accuracy = expected_accuracy(model, tokenizer, held_out, config.task)
            if accuracy >= config.target_accuracy:
                break
    else:
        raise RuntimeError(
            f"warm start on task {config.task!r} reached expected accuracy {accuracy:.3f} after {config.max_steps} "
            f"steps, short of target_accuracy={config.target_accuracy}; raise max_steps or lower the target"
        )
    model.eval()
    by_task: dict[str, list[Problem]] = {}
    for p in held_out:
        by_task.setdefault(p.task, []).append(p)
    return {
        "steps": step,
        "train_loss": loss_value,
        "eval_expected_accuracy": accuracy,
        "eval_expected_accuracy_by_task": {
            name: expected_accuracy(model, tokenizer, probs) for name, probs in sorted(by_task.items())
        },
        "eval_problems": len(held_out),
        "train_expected_accuracy": expected_accuracy(model, tokenizer, list(dict.fromkeys(train)), config.task),
    }


def build_toy_model(
    config: ToyConfig | None = None, *, cache_dir: str | Path | None = None, force: bool = False, **overrides: Any
) -> Path:
    """Build (or find in the cache) the warm-started toy model; return its directory.

    ``config`` defaults to ``ToyConfig()``; keyword ``overrides`` replace its fields (``build_toy_model(task="add2")``).
    ``cache_dir`` defaults to :func:`cache_root`; ``force`` rebuilds even when cached. The directory holds
    ``config.json``, ``model.safetensors``, the tokenizer files and ``trustscope_toy.json`` (see ``META_FILE``).
    """
    config = dataclasses.replace(config or ToyConfig(), **overrides)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "toy" / f"{config.task}-{config.key()}"
    if (final / META_FILE).exists() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        start = time.perf_counter()
        tokenizer = toy_tokenizer()
        model = new_toy_model(config, tokenizer).to(config.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(config.num_threads)
        try:
            record = warm_start(model, tokenizer, config)
        finally:
            torch.set_num_threads(threads)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {
            "config": dataclasses.asdict(config),
            "key": config.key(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - start, 2),
            "warm_start": record,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if force and final.exists():
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # another builder renamed its copy first: keep theirs
            if not (final / META_FILE).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def toy_meta(model_dir: str | Path) -> dict[str, Any]:
    """The build record (``trustscope_toy.json``) of a toy model directory."""
    path = Path(model_dir) / META_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {model_dir} is not a toy model built by build_toy_model")
    return json.loads(path.read_text())


def load_toy_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a toy model directory (any save_pretrained causal LM works)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model, AutoTokenizer.from_pretrained(str(model_dir))
