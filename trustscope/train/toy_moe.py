"""The toy world's mixture-of-experts preset: a tiny Qwen3-MoE (a few experts a layer, top-2) with the toy
character tokenizer, built and warm-started locally like the dense presets, that transformers and vLLM both run.

Every layer routes each token to ``num_experts_per_tok`` of ``num_experts`` experts; bf16 rollouts against the fp32
trainer then route some tokens differently (see :mod:`trustscope.routing` and ``trustscope parity``). The build
reuses :mod:`trustscope.train.toy` (tokenizer, tasks, warm start, accuracy) and is cached the same way under
``$TRUSTSCOPE_CACHE/toy``, keyed by the configuration and the source of both modules.

    from trustscope.train.toy_moe import MOE_PRESETS, build_toy_moe_model
    model_dir = build_toy_moe_model(MOE_PRESETS["toy-moe"])

The preset is warm-started on ``add1`` to an expected accuracy of 0.4 (the dense ``toy``'s target, 0.5, was not
reached in 2,000 warm-start steps: the MoE plateaued at 0.44), which leaves RL room to improve.
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
    missing(exc, "trustscope.train.toy_moe")

from trustscope.paths import cache_root
from trustscope.train import toy
from trustscope.train.builds import staged_build


@dataclass(frozen=True)
class ToyMoeConfig(toy.ToyConfig):
    """A :class:`~trustscope.train.toy.ToyConfig` with experts: each layer's MLP is ``num_experts`` experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them routed per token (weights renormalised)."""

    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    router_init_std: float | None = None
    """Standard deviation of the routers' initial weights (None: the model's ``initializer_range``)."""
    freeze_router: bool = False
    """Keep the routers at their initial weights during the warm start: the experts learn around a router that
    was never sharpened, so its top-k choices sit near ties (RL then trains the routers like any weight)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts < 2:
            raise ValueError(f"num_experts must be >= 2, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                             f"{self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.router_init_std is not None and not self.router_init_std > 0:
            raise ValueError(f"router_init_std must be > 0 (or None), got {self.router_init_std}")

    def key(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("num_threads", "device")
                  and not (k in _ROUTER_FIELDS and v == _ROUTER_FIELDS[k])}  # presets before them keep their key
        blob = (json.dumps(fields, sort_keys=True) + toy.TOY_VERSION + Path(toy.__file__).read_text()
                + Path(__file__).read_text())
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_ROUTER_FIELDS = {"router_init_std": None, "freeze_router": False}

MOE_PRESETS: dict[str, ToyMoeConfig] = {
    "toy-moe": ToyMoeConfig(task="add1", target_accuracy=0.4, max_steps=2000),
    "toy-moe-flip": ToyMoeConfig(task="add1", target_accuracy=0.4, max_steps=2000, num_hidden_layers=4,
                                 num_experts=16, router_init_std=0.2, freeze_router=True),
}
"""Named MoE toy worlds: ``toy-moe``, two layers of four experts (top-2) on one-digit addition, whose trained
routers are decisive (bf16 rollouts flip none of their choices); ``toy-moe-flip``, four layers of sixteen experts
(top-2) whose routers were left at a random initialisation (std 0.2) through the warm start, so their top-2 sit
near ties and bf16 rollouts flip about 1% of the (layer, slot) choices, 5-8% of tokens in some layer."""


def new_toy_moe_model(config: ToyMoeConfig, tokenizer) -> torch.nn.Module:
    """A randomly initialised Qwen3MoeForCausalLM for ``config`` (float32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size, num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok, decoder_sparse_step=1, norm_topk_prob=True,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0, output_router_logits=False,
    )
    torch.manual_seed(config.seed)
    model = Qwen3MoeForCausalLM(cfg).float()
    if config.router_init_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, config.router_init_std)
    return model


def build_toy_moe_model(config: ToyMoeConfig | None = None, *, cache_dir: str | Path | None = None,
                        force: bool = False, **overrides: Any) -> Path:
    """Build (or find in the cache) the warm-started MoE toy model; return its directory (the layout of
    :func:`trustscope.train.toy.build_toy_model`, ``trustscope_toy.json`` included)."""
    config = dataclasses.replace(config or MOE_PRESETS["toy-moe"], **overrides)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / "toy" / f"moe-{config.task}-{config.key()}"
    if (final / toy.META_FILE).exists() and not force:
        return final
    with staged_build(final, force=force) as tmp:
        start = time.perf_counter()
        tokenizer = toy.toy_tokenizer()
        model = new_toy_moe_model(config, tokenizer).to(config.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(config.num_threads)
        gates = [layer.mlp.gate.weight for layer in model.model.layers] if config.freeze_router else []
        for w in gates:
            w.requires_grad_(False)
        try:
            record = toy.warm_start(model, tokenizer, config)
        finally:
            torch.set_num_threads(threads)
            for w in gates:
                w.requires_grad_(True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"config": dataclasses.asdict(config), "key": config.key(), "architecture": "Qwen3MoeForCausalLM",
                "parameters": sum(p.numel() for p in model.parameters()),
                "build_seconds": round(time.perf_counter() - start, 2), "warm_start": record}
        (tmp / toy.META_FILE).write_text(json.dumps(meta, indent=2))
    return final
