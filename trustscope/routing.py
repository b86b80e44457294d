"""Mixture-of-experts routing on both sides, per token: the experts the trainer's router picks and the experts the
rollout engine picked, and how far they agree.

A token's routing is an ``(L, k)`` array of expert ids: for each of the model's L MoE layers, the k experts its
router chose (top-k), at the position whose output predicts the token (the position before it: the last prompt
token for the first response token), the same alignment as the logits. Agreement is counted per (layer, slot):
the share of the engine's L x k choices that the trainer's router also chose in that layer (order within a layer
does not matter: the experts' outputs are summed).

- Trainer side (:class:`TrainerRouting`): forward hooks on the transformers model's router modules (Qwen3-MoE's
  ``mlp.gate``, Mixtral's ``mlp.gate``, any module returning ``(logits, weights, indices)`` or plain logits).
- Engine side (:class:`VLLMRouting`): vLLM's own capture point, the MoE router's ``set_capture_fn`` (called with
  the logical expert ids the fused-MoE kernel then uses), set on every MoE layer of the in-process worker. vLLM's
  ``enable_return_routed_experts`` needs its Model Runner V2, which needs Triton, which the CPU build lacks
  (``AuxOutput Connector requires Model Runner V2``, then ``Model Runner V2 requires Triton``); the capture point
  it would use is the same. Each request is generated alone so every forward pass holds that request's tokens
  only, in order (the prompt's prefill, then one decode row per token), with prefix caching off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def moe_shape(config: Any) -> tuple[int, int, int] | None:
    """``(num_moe_layers, top_k, num_experts)`` of a transformers config, or None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    layers = int(config.num_hidden_layers)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return len(moe_layers), int(top_k), int(experts)


def check_routing(value: Any, name: str, shape: tuple[int, int, int] | None, tokens: int | None = None) -> np.ndarray:
    """``value`` as an int16 array ``(N, L, k)`` of expert ids; ValueError naming ``name`` and the shapes when the
    model is dense (``shape`` None), when ``(L, k)`` disagrees with the model's, or an id is out of range."""
    arr = np.asarray(value)
    if shape is None:
        raise ValueError(f"{name}: routing given for a dense model (it has no MoE layers); got shape {arr.shape}")
    layers, top_k, experts = shape
    if arr.ndim != 3 or arr.shape[1:] != (layers, top_k) or (tokens is not None and arr.shape[0] != tokens):
        want = f"({tokens if tokens is not None else 'N'}, {layers}, {top_k})"
        raise ValueError(f"{name} has shape {arr.shape}, the model routes {want} (tokens, MoE layers, top-k)")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= experts):
        bad = arr[(arr < 0) | (arr >= experts)][0]
        raise ValueError(f"{name}: expert id {int(bad)} out of range [0, {experts})")
    return arr.astype(np.int16)


def agreement(engine: np.ndarray, trainer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token ``(N,)``: the share of the engine's (layer, slot) choices the trainer also made in that layer; per
    token and layer ``(N, L)``: the same share within each layer. Inputs ``(N, L, k)``."""
    if engine.shape != trainer.shape:
        raise ValueError(f"engine routing {engine.shape} and trainer routing {trainer.shape} differ in shape")
    hit = (engine[..., :, None] == trainer[..., None, :]).any(-1)  # (N, L, k)
    by_layer = hit.mean(-1)  # (N, L)
    return by_layer.mean(-1), by_layer


@contextlib.contextmanager
def forward_hooks(modules: Sequence[Any], hook: Callable[[int], Callable[..., Any]]) -> Iterator[None]:
    """``hook(i)`` registered as the forward hook of the ``i``-th of ``modules`` for the block, removed after it."""
    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _router_indices(output: Any, top_k: int) -> torch.Tensor:
    """``(rows, k)`` expert ids from a router module's output: ``(logits, weights, indices)`` or plain logits."""

    if isinstance(output, tuple) and len(output) >= 3 and not output[2].is_floating_point():
        return output[2]
    logits = output[0] if isinstance(output, tuple) else output
    return logits.topk(top_k, dim=-1).indices


def _router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of each MoE layer, in layer order: a ``mlp.gate`` / ``block_sparse_moe.gate`` child of a
    decoder layer."""
    out = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "gate" and parts[-2] in ("mlp", "block_sparse_moe"):
            out.append(module)
    return out


class TrainerRouting:
    """Forward hooks on a transformers MoE model's routers: after a forward pass on ``(B, S)`` inputs, :meth:`take`
    returns the ``(B, S, L, k)`` expert ids of every position. With ``hooked(forwards=True)`` every forward pass
    is kept, and :meth:`take_forwards` lays a ``generate``'s passes (the prefill, then one row per decode step) end
    to end: the transformers engine's side (:class:`trustscope.engines.hf.HFEngine`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        shape = moe_shape(model.config)
        if shape is None:
            raise ValueError("TrainerRouting: the model is dense (its config names no experts)")
        self.layers, self.top_k, self.num_experts = shape
        self.modules = _router_modules(model)
        if len(self.modules) != self.layers:
            raise ValueError(f"TrainerRouting: found {len(self.modules)} router modules, the config has "
                             f"{self.layers} MoE layers")
        self._rows: list[torch.Tensor | None] = [None] * self.layers
        self._forwards: list[list[torch.Tensor]] = [[] for _ in range(self.layers)]

    @contextlib.contextmanager
    def hooked(self, forwards: bool = False) -> Iterator[TrainerRouting]:
        """Record the routers' choices in the block: the last forward pass's for :meth:`take`, or (``forwards``)
        every pass's, in order, for :meth:`take_forwards`."""
        import torch

        self._forwards = [[] for _ in range(self.layers)]

        def hook(i: int):
            def record(module: torch.nn.Module, args: Any, output: Any) -> None:
                rows = _router_indices(output, self.top_k).detach().to("cpu", torch.int16)
                if forwards:
                    self._forwards[i].append(rows)
                else:
                    self._rows[i] = rows
            return record

        with forward_hooks(self.modules, hook):
            yield self

    def take_forwards(self, batch: int) -> np.ndarray:
        """``(B, S_1 + S_2 + ..., L, k)``: the passes recorded by ``hooked(forwards=True)``, each on ``(B, S_f)``
        inputs, concatenated along the positions in the order they ran."""
        import torch

        counts = {len(f) for f in self._forwards}
        if counts != {len(self._forwards[0])} or not self._forwards[0]:
            raise RuntimeError(f"TrainerRouting.take_forwards: the MoE layers recorded {sorted(counts)} forward "
                               f"passes (none, or different numbers)")
        per_layer = [torch.cat([r.reshape(batch, -1, self.top_k) for r in f], 1) for f in self._forwards]
        self._forwards = [[] for _ in range(self.layers)]
        return torch.stack(per_layer, 2).numpy()  # (B, S, L, k)

    def take(self, batch: int, seq: int) -> np.ndarray:
        import torch

        if any(r is None for r in self._rows):
            raise RuntimeError("TrainerRouting.take: no forward pass was recorded")
        rows = torch.stack([r.reshape(batch, seq, self.top_k) for r in self._rows], 2)  # (B, S, L, k)
        self._rows = [None] * self.layers
        return rows.numpy()


class VLLMRouting:
    """The experts vLLM's fused-MoE kernels were handed, per layer, through each router's ``set_capture_fn``
    (in-process engines only). :meth:`take` after generating one request returns its ``(rows, L, k)`` ids in the
    order the tokens went through the model."""

    def __init__(self, llm: Any, shape: tuple[int, int, int]) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.layers, self.top_k, self.num_experts = shape
        self._chunks: dict[int, list[torch.Tensor]] = {}
        found: list[int] = []

        def bind(worker: Any) -> int:
            for module in worker.model_runner.model.modules():
                router = getattr(module, "router", None)
                if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                    if getattr(module, "is_monolithic", False):
                        raise RuntimeError("VLLMRouting: a monolithic MoE kernel has no router capture point")
                    layer = int(module.layer_id)
                    router.set_capture_fn(lambda ids, layer=layer: self._chunks.setdefault(layer, []).append(
                        ids.detach().to("cpu", torch.int16).clone()))
                    found.append(layer)
            return len(found)

        llm.collective_rpc(bind)
        if len(found) != self.layers:
            raise RuntimeError(f"VLLMRouting: bound {len(found)} MoE routers, the model has {self.layers} MoE layers")
        self._order = sorted(found)

    def reset(self) -> None:
        self._chunks = {}

    def take(self) -> np.ndarray:
        import torch

        per_layer = [torch.cat(self._chunks.get(layer, [torch.zeros((0, self.top_k), dtype=torch.int16)]))
                     for layer in self._order]
        rows = {len(p) for p in per_layer}
        if len(rows) != 1:
            raise RuntimeError(f"VLLMRouting: layers captured different numbers of rows {sorted(rows)}")
        self.reset()
        return torch.stack(per_layer, 1).numpy()  # (rows, L, k)


def check_routing_shape(shape: Any) -> tuple[int, int, int]:
    """``(MoE layers, top-k, experts)`` as ints; ValueError naming ``routing_shape`` otherwise."""
    try:
        layers, top_k, experts = (int(x) for x in shape)
    except (TypeError, ValueError):
        raise ValueError(f"routing_shape must be (MoE layers, top-k, experts), got {shape!r}") from None
    if layers < 1 or experts < 2 or not 1 <= top_k <= experts or experts > np.iinfo(np.int16).max:
        raise ValueError(f"routing_shape {shape!r}: need layers >= 1, 2 <= experts <= 32767, 1 <= top-k <= experts")
    return layers, top_k, experts


class VLLMBatchRouting:
    """The experts vLLM routed every token of a batched ``generate`` to, per request, through the same capture
    point as :class:`VLLMRouting` (in-process engines only), without generating requests one at a time.

    At each forward pass the first MoE layer's capture also notes the batch's layout from the model runner: which
    request each row belongs to (``query_start_loc``), the position of its first row (``num_computed_tokens``)
    and the token ids fed (``input_ids``). :meth:`take` then gives each generated sample the ``(P + T - 1, L, k)``
    expert ids of the positions its prompt and response went through (the last sampled token is never fed),
    matched to the request by its token sequence. Needs prefix caching off, so every position is computed."""

    def __init__(self, llm: Any, shape: tuple[int, int, int]) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.layers, self.top_k, self.num_experts = shape
        self._forwards: list[dict[str, Any]] = []
        found: list[int] = []

        def bind(worker: Any) -> int:
            runner = worker.model_runner
            routers = []
            for module in runner.model.modules():
                router = getattr(module, "router", None)
                if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                    if getattr(module, "is_monolithic", False):
                        raise RuntimeError("VLLMBatchRouting: a monolithic MoE kernel has no router capture point")
                    routers.append((int(module.layer_id), router))
            routers.sort(key=lambda lr: lr[0])
            first = routers[0][0] if routers else None

            def record(ids: torch.Tensor, layer: int) -> None:
                if layer == first:
                    n = int(runner.input_batch.num_reqs)
                    qsl = runner.query_start_loc.np[: n + 1].copy()
                    self._forwards.append({
                        "req_ids": list(runner.input_batch.req_ids[:n]), "qsl": qsl,
                        "computed": runner.input_batch.num_computed_tokens_cpu[:n].copy(),
                        "tokens": runner.input_ids.cpu[: int(qsl[-1])].numpy().copy(), "rows": {}})
                if self._forwards:
                    self._forwards[-1]["rows"][layer] = ids.detach()[: len(self._forwards[-1]["tokens"])].to(
                        "cpu", torch.int16).numpy().copy()

            for layer, router in routers:
                router.set_capture_fn(lambda ids, layer=layer: record(ids, layer))
                found.append(layer)
            return len(found)

        llm.collective_rpc(bind)
        if len(found) != self.layers:
            raise RuntimeError(f"VLLMBatchRouting: bound {len(found)} MoE routers, the model has {self.layers} MoE "
                               f"layers")
        self._order = sorted(found)

    def reset(self) -> None:
        self._forwards = []

    def take(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[np.ndarray]:
        """Per sample, ``(P + T - 1, L, k)`` int16 expert ids of sequence positions ``0 .. P + T - 2``."""
        per_req: dict[str, dict[int, tuple[int, np.ndarray]]] = {}  # request -> position -> (token, (L, k))
        for fwd in self._forwards:
            if len(fwd["rows"]) != self.layers:
                raise RuntimeError(f"VLLMBatchRouting: a forward pass routed {len(fwd['rows'])} of {self.layers} "
                                   f"MoE layers")
            rows = np.stack([fwd["rows"][layer] for layer in self._order], 1)  # (rows, L, k)
            qsl = fwd["qsl"]
            for r, req in enumerate(fwd["req_ids"]):
                slots = per_req.setdefault(req, {})
                for j in range(int(qsl[r]), int(qsl[r + 1])):
                    slots[int(fwd["computed"][r]) + j - int(qsl[r])] = (int(fwd["tokens"][j]), rows[j])
        self.reset()
        by_tokens: dict[tuple[int, ...], list[np.ndarray]] = {}
        for slots in per_req.values():
            n = len(slots)
            if sorted(slots) != list(range(n)):
                raise RuntimeError("VLLMBatchRouting: a request's positions were not all computed (is prefix "
                                   "caching off?)")
            by_tokens.setdefault(tuple(slots[i][0] for i in range(n)), []).append(
                np.stack([slots[i][1] for i in range(n)]))
        out = []
        for prompt, response in zip(prompt_ids, response_ids, strict=True):
            seq = tuple(prompt) + tuple(response[:-1])
            found = by_tokens.get(seq)
            if not found:
                raise RuntimeError(f"VLLMBatchRouting: no routed request matches a {len(prompt)}-token prompt with a "
                                   f"{len(response)}-token response")
            out.append(found.pop(0) if len(found) > 1 else found[0])
        return out


def padded_routing(rows: list[np.ndarray], prompt_lens: list[int], prompt_len: int, width: int) -> np.ndarray:
    """Per-sample ``(P_i + T_i - 1, L, k)`` routings laid out like the trainer's inputs (prompts left-padded to
    ``prompt_len``, width P + T): ``(B, width, L, k)`` int16, -1 where a column holds no routed position."""
    layers, top_k = rows[0].shape[1:] if rows else (1, 1)
    out = np.full((len(rows), width, layers, top_k), -1, dtype=np.int16)
    for i, (r, n_p) in enumerate(zip(rows, prompt_lens, strict=True)):
        start = prompt_len - n_p
        out[i, start: start + len(r)] = r
    return out


class RouterReplay:
    """Routing replay (R3) on a transformers MoE model: while :meth:`replayed` is active, each router's forward
    keeps its logits but its top-k experts are the ones given (the engine's), and the routing weights are the
    router's own softmax at those experts (renormalised over the k when the model normalises its top-k), so the
    router still gets gradients. Positions given -1 keep the router's own choice. The trainer's own choices
    (before replay) are recorded too, as :class:`TrainerRouting` would."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tracker = TrainerRouting(model)
        self.norm_topk = bool(getattr(model.config, "norm_topk_prob", True))
        self._counts = [0, 0]  # (choices replaced, choices given) in the last replayed forward
        self._own: list[torch.Tensor | None] = [None] * self.tracker.layers  # each router's own pick, last forward

    @property
    def replaced(self) -> float:
        """The share of the router's own (position, layer, slot) choices that the last replayed forward replaced
        by the given experts."""
        return self._counts[0] / self._counts[1] if self._counts[1] else 0.0

    def take_own(self, batch: int, seq: int) -> np.ndarray:
        """``(B, S, L, k)``: the experts each router picked itself in the last forward, before the replay replaced
        them (what the replace rate compares the engine's with)."""
        import torch

        if any(r is None for r in self._own):
            raise RuntimeError("RouterReplay.take_own: no forward pass was recorded")
        rows = torch.stack([r.reshape(batch, seq, self.tracker.top_k) for r in self._own], 2)
        self._own = [None] * self.tracker.layers
        return rows.numpy()

    @contextlib.contextmanager
    def replayed(self, experts: torch.Tensor | None) -> Iterator[TrainerRouting]:
        """``experts``: ``(B, S, L, k)`` long ids for the forward's ``(B, S)`` inputs, or None to record only."""
        import torch

        tr = self.tracker
        self._counts = [0, 0]

        def hook(i: int):
            def replace(module: torch.nn.Module, args: Any, output: Any) -> Any:
                own = _router_indices(output, tr.top_k)
                tr._rows[i] = self._own[i] = own.detach().to("cpu", torch.int16)
                if experts is None:
                    return None
                logits = output[0] if isinstance(output, tuple) else output
                given = experts[:, :, i].reshape(-1, tr.top_k).to(own.device)  # (rows, k)
                chosen = torch.where(given >= 0, given, own)
                tr._rows[i] = chosen.detach().to("cpu", torch.int16)  # the experts this forward used
                ran = (given >= 0).all(-1)
                kept = (own[..., :, None] == chosen[..., None, :]).any(-1)  # (rows, k)
                self._counts[0] += int((~kept[ran]).sum())
                self._counts[1] += int(ran.sum()) * tr.top_k
                probs = logits.float().softmax(-1).gather(-1, chosen)
                if self.norm_topk:
                    probs = probs / probs.sum(-1, keepdim=True)
                return logits, probs.to(logits.dtype), chosen
            return replace

        with forward_hooks(tr.modules, hook):
            yield tr


def replace_rate_lines(exact: Any) -> list[str]:
    """The report's replace-rate line of one run from its ``routing_agreement`` query rows (``exact``, a frame with
    ``dimension``, ``bucket`` and ``replace_rate``): the share of the router's own (layer, slot) choices routing
    replay replaced, overall and per MoE layer, exact over every token; none where the run logs no router's own pick
    (``router_experts``)."""
    if "replace_rate" not in exact:
        return []
    whole = exact[exact["dimension"] == "all"]
    if whole.empty or whole["replace_rate"].isna().all():
        return []
    layers = exact[exact["dimension"] == "layer"].sort_values("bucket")
    return [f"  routing replay replaced {whole['replace_rate'].iloc[0]:.2%} of the router's own choices; by layer: "
            + ", ".join(f"{int(r.bucket)}: {r.replace_rate:.2%}" for r in layers.itertuples())]
