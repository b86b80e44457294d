"""Import slime's and miles' ``--dump-details`` directories (``rollout_data/<id>.pt`` + ``train_data/``).

Writers read:

- Rollout side, both frameworks: ``save_debug_rollout_data`` (slime ``slime/observability/rollout_data_utils.py``;
  miles ``miles/ray/rollout/debug_data.py``): ``torch.save({"rollout_id", "samples": [Sample.to_dict()],
  ["metadata"]})``, one file per rollout step; ``eval_<id>.pt`` files are evaluations and are skipped. Per sample:
  ``index``, ``group_index``, ``prompt`` (text or chat messages), ``tokens`` (prompt + response ids),
  ``response``, ``response_length``, ``reward`` (a number or a dict), ``loss_mask`` (response length, or None =
  all ones), ``rollout_log_probs`` (the SGLang engine's, response length), ``status``, ``remove_sample``.
- Train side, per rank (miles ``miles/utils/train_dump_utils.py`` ``save_debug_train_data_for_rank``, and slime
  before #2266): ``train_data/<id>_<rank>.pt`` = ``{"rollout_id", "rank", "rollout_data", ["cp_rank", "cp_size",
  "qkv_format"]}``. ``rollout_data`` is the rank's DP shard as the actor holds it after training: lists with one
  entry per sample (``sample_indices`` = ``Sample.index``, ``tokens``, ``total_lengths``, ``response_lengths``,
  ``loss_masks``, ``rewards``) and ``raw_reward`` batch-global in rollout order. The per-token fields
  ``log_probs``, ``rollout_log_probs``, ``ref_log_probs``, ``entropy``, ``ref_entropy``, ``advantages``,
  ``returns`` hold only the rank's context-parallel slice (the zigzag of
  ``miles/backends/training_utils/cp_utils.py`` ``get_logits_and_tokens_offset_with_cp``: the sequence is cut in
  ``2 * cp_size`` chunks, rank r holds chunks r and ``2 * cp_size - 1 - r``); tensor-parallel peers write copies,
  and pipeline stages other than the last hold no trainer fields. The importer puts the slices back together
  (every CP rank must be present) as ``miles/dashboard/dump_reader.py`` does; files without ``cp_rank`` get their
  layout recovered the way that reader does it (distinct ``rollout_log_probs`` slices in global-rank order are CP
  ranks 0, 1, ..., checked against the zigzag's widths).
- Train side, slime since #2266 (``slime/observability/train_data_utils.py`` ``save_debug_train_data``):
  ``train_data/<id>.pt`` = ``{"format_version": 2, "rollout_id", "rank", "samples", "dp_shards",
  ["raw_reward"]}``, CP fields already restored to full response length, one dict per sample with
  ``rollout_position`` (index into the rollout dump's samples) and ``sample_index``.

Mapping: rows are the response tokens (``tokens[-response_length:]``) with ``loss_mask`` 1 (tool output is 0);
``mu_logprob`` = the rollout dump's ``rollout_log_probs`` (else the train dump's); ``pi_logprob`` and
``old_logprob`` = ``log_probs``, the trainer's recompute *before* the update (pi_old): the dumps hold no log-prob
of the updated policy, so pi here is pi_old and ratio-based rules replay on pi_old / mu (the training-inference
mismatch, which is what the dump can show). ``advantage`` = ``advantages``; ``entropy`` = ``entropy`` when
dumped; ``kept`` is false on every token of a ``remove_sample`` sample and true elsewhere (the PPO clip mask
itself is not dumped). Samples: ``sample_id`` = ``Sample.index``, ``prompt_id`` = ``group_index``, prompt and
response text, reward (``Sample.reward`` when a number, else ``raw_reward``), ``finish_reason`` = ``status``.

Routed experts (mixture-of-experts runs with ``--use-rollout-routing-replay``): the rollout dump's
``rollout_routed_experts``, the SGLang engine's experts as the rollout decoded them from ``meta_info`` (miles
``rollout/generate_utils``: int32 of shape ``(len(tokens) - 1, num_layers, moe_router_topk)``, row i the experts
position i was routed to, whose output predicts token i + 1; -1 rows are miles' filler). The response's tokens are
predicted by rows ``prompt - 1 .. len(tokens) - 2``, which become ``engine_experts``. The dump holds the engine's
side only (the trainer replays it, recording none of its own), so there is no ``trainer_experts`` and no agreement.

``.pt`` files are loaded with ``torch.load(weights_only=True)``; a dump holding other objects (numpy arrays of
routed experts, custom classes) needs ``allow_pickle=True``, for files you trust.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from trustscope.importers.base import (
    ImportedRun,
    ImportFormatError,
    Listing,
    SameThroughout,
    Sequence,
    SourceGone,
    register_importer,
)

CP_FIELDS = ("log_probs", "rollout_log_probs", "ref_log_probs", "entropy", "ref_entropy", "advantages", "returns")
_TRAIN_FILE = re.compile(r"^(\d+)(?:_(\d+))?\.pt$")
_ROLLOUT_FILE = re.compile(r"^(\d+)\.pt$")

ALLOW_PICKLE = {"allow_pickle": "unpickle .pt files that hold more than tensors and plain values (only for files "
                                "you trust)"}
MIXED = "dumps of two writer versions are mixed"
KINDS = {"single": "a single-file train dump", "per-rank": "a per-rank train dump"}

NOTES = {
    "mu_logprob": "rollout_log_probs (SGLang's, from the rollout dump; the train dump's when absent there)",
    "pi_logprob": "log_probs: the trainer's recompute before the update (pi_old); the dump holds no post-update "
                  "log-prob, so pi = pi_old here",
    "old_logprob": "log_probs (pi_old, the same values as pi_logprob)",
    "advantage": "advantages (per token)",
    "entropy": "entropy when dumped (--use-rollout-entropy / entropy loss), else null",
    "kept": "false on remove_sample samples; the PPO clip mask is not dumped",
    "rows": "response tokens with loss_mask 1",
    "policy_version": "weight_versions[0] - 1 (Sample.weight_versions: the engine's weight version at each "
                      "generation call; slime pushes version 1 before rollout 0 and one more after each training "
                      "step); null when the dump has none",
    "policy_version_last": "weight_versions[-1] - 1: the last version a partial rollout was continued with",
}
ROUTING_NOTE = ("rollout_routed_experts (the engine's; row t - 1 of (len(tokens) - 1, layers, top-k) predicts "
                "token t); the dump has no trainer side, so no trainer_experts or agreement")


def load_pt(path: Path, allow_pickle: bool) -> Any:
    """``torch.load`` on CPU; a truncated or foreign file is an :class:`ImportFormatError` naming it."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as err:
        raise ImportFormatError(f"{path}: holds objects beyond tensors and plain values ({str(err).splitlines()[0]}); "
                                f"import with allow_pickle (--allow-pickle) if you trust the file") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, zipfile errors ... for a cut or foreign file
        raise ImportFormatError(f"{path}: not a readable torch file ({type(err).__name__}: {err})") from None


def _array(value: Any, where: str, dtype: Any) -> np.ndarray:
    """A tensor or list as a 1-D numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().float().numpy() if dtype is np.float32 else value.detach().numpy()
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as err:
        raise ImportFormatError(f"{where}: not a sequence of numbers ({err})") from None
    if arr.ndim != 1:
        raise ImportFormatError(f"{where}: expected a 1-D sequence, got shape {arr.shape}")
    return arr


def _get(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict):
        raise ImportFormatError(f"{where}: expected a dict, got {type(mapping).__name__}")
    if key not in mapping:
        raise ImportFormatError(f"{where}[{key!r}]: missing")
    return mapping[key]


def cp_slices(total_length: int, response_length: int, cp_rank: int, cp_size: int,
              max_seq_len: int | None = None) -> list[tuple[int, int]]:
    """The response positions ``[start, end)`` (two, possibly empty) that CP rank ``cp_rank`` holds, in order.

    The zigzag split of the whole sequence (prompt included, or ``max_seq_len`` for the bshd layout) into
    ``2 * cp_size`` chunks; a log-prob at logit index i scores token i + 1, so response position = i - (prompt - 1).
    """
    prompt = total_length - response_length
    chunk = ((max_seq_len or total_length) + 2 * cp_size - 1) // (2 * cp_size)
    out = []
    for c in (cp_rank, 2 * cp_size - cp_rank - 1):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total_length - 1)
        out.append((lo - (prompt - 1), hi - (prompt - 1)) if lo < hi else (0, 0))
    return out


def assemble_cp(chunks: dict[int, np.ndarray], total_length: int, response_length: int, cp_size: int,
                where: str, max_seq_len: int | None = None) -> np.ndarray:
    """Full ``(response_length,)`` values from every CP rank's slice ``{cp_rank: (n_r,)}``."""
    missing = sorted(set(range(cp_size)) - set(chunks))
    if missing:
        raise ImportFormatError(f"{where}: context-parallel rank(s) {missing} of {cp_size} missing; the slices "
                                f"cannot be put together")
    out = np.zeros(response_length, dtype=np.float32)
    for cp_rank, chunk in chunks.items():
        parts = cp_slices(total_length, response_length, cp_rank, cp_size, max_seq_len)
        want = sum(e - s for s, e in parts)
        if len(chunk) != want:
            raise ImportFormatError(f"{where}: CP rank {cp_rank} holds {len(chunk)} value(s), its zigzag slice of a "
                                    f"{total_length}-token sequence with a {response_length}-token response "
                                    f"has {want}")
        offset = 0
        for s, e in parts:
            out[s:e] = chunk[offset: offset + e - s]
            offset += e - s
    return out


def _rollout_files(src: Path) -> dict[int, Path]:
    rollout_dir = src / "rollout_data"
    if not rollout_dir.is_dir():
        raise ImportFormatError(f"{src}: no rollout_data/ directory (expected a --dump-details directory)")
    found = {int(m.group(1)): p for p in rollout_dir.iterdir() if (m := _ROLLOUT_FILE.match(p.name))}
    if not found:
        raise ImportFormatError(f"{rollout_dir}: no <rollout_id>.pt files")
    return found


def _train_files(src: Path) -> dict[int, tuple[str, list[tuple[int, Path]]]]:
    """``{rollout_id: (kind, [(rank, path)])}``; kind ``"single"`` (slime format 2) or ``"per-rank"``."""
    train_dir = src / "train_data"
    if not train_dir.is_dir():
        raise ImportFormatError(f"{src}: no train_data/ directory (the run dumped no training side)")
    out: dict[int, tuple[str, list[tuple[int, Path]]]] = {}
    kinds = SameThroughout(MIXED, KINDS.__getitem__)
    for path in sorted(train_dir.iterdir()):
        m = _TRAIN_FILE.match(path.name)
        if not m:
            continue
        rid, kind = int(m.group(1)), "single" if m.group(2) is None else "per-rank"
        kinds.check(kind, str(path))
        out.setdefault(rid, (kind, []))[1].append((int(m.group(2) or 0), path))
    return out


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return None


def _reward(sample: dict, raw_reward: Any, position: int) -> float | None:
    reward = sample.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        return float(reward)
    if raw_reward is not None and position < len(raw_reward):
        value = raw_reward[position]
        return float(value.item() if hasattr(value, "item") else value)
    return None


def _legacy_cp_layout(locations: list[tuple[int, Path, dict, dict, int]], total: int, resp: int,
                      where: str) -> tuple[int, dict[int, int]]:
    """``(cp_size, {id(pack): cp_rank})`` for per-rank files written before ``cp_rank`` was recorded.

    As ``miles/dashboard/dump_reader.py`` recovers it: ``rollout_log_probs`` (on every rank) is the probe; files
    holding equal slices are tensor-parallel peers, distinct slices in global-rank order are CP ranks 0, 1, ...
    (Megatron orders ranks tp-cp-dp-pp), and their widths must be exactly the zigzag's, or the layout is refused.
    """
    groups: list[np.ndarray] = []
    cp_of: dict[int, int] = {}
    for _, path, pack, data, row in sorted(locations, key=lambda loc: loc[0]):
        probe = data.get("rollout_log_probs")
        if probe is None:
            raise ImportFormatError(f"{path}[rollout_data]['rollout_log_probs']: missing; without cp_rank in the "
                                    f"files it is needed to tell the context-parallel slices apart")
        value = _array(probe[row], f"{path}[rollout_log_probs][{row}]", np.float32)
        match = next((i for i, g in enumerate(groups) if len(g) == len(value) and np.array_equal(g, value)), None)
        if match is None:
            match = len(groups)
            groups.append(value)
        cp_of[id(pack)] = match
    cp_size = len(groups)
    widths = [len(g) for g in groups]
    want = [sum(e - s for s, e in cp_slices(total, resp, r, cp_size)) for r in range(cp_size)] if cp_size > 1 \
        else [resp]
    if widths != want:
        raise ImportFormatError(f"{where}: rollout_log_probs slices of widths {widths} are not the context-parallel "
                                f"zigzag of a {total}-token sequence ({want} for cp_size {cp_size}), and the files "
                                f"(written before cp_rank was recorded) do not say which rank holds which")
    return cp_size, cp_of


def _train_rows_per_rank(files: list[tuple[int, Path]], rid: int, allow_pickle: bool
                         ) -> tuple[dict[int, dict[str, Any]], Any, str]:
    """``{sample_index: {field: full-length values, "rank": r, "where": ...}}`` from the per-rank files of one
    rollout, CP slices joined; plus ``raw_reward`` and a layout label."""
    packs = []
    for rank, path in sorted(files):
        pack = load_pt(path, allow_pickle)
        data = _get(pack, "rollout_data", str(path))
        if _get(pack, "rollout_id", str(path)) != rid:
            raise ImportFormatError(f"{path}: rollout_id {pack['rollout_id']!r}, the file name says {rid}")
        for key in ("sample_indices", "tokens", "total_lengths", "response_lengths"):
            _get(data, key, f"{path}[rollout_data]")
        packs.append((rank, path, pack, data))
    recorded = SameThroughout(MIXED, lambda has: "cp_rank recorded" if has else "no cp_rank recorded")
    for _, path, pack, _ in packs:
        recorded.check("cp_rank" in pack, str(path))
    has_cp_rank = recorded.value
    cp_sizes = {int(pack.get("cp_size", 1) or 1) for _, _, pack, _ in packs}
    if len(cp_sizes) > 1:
        raise ImportFormatError(f"{files[0][1].parent}: rollout {rid} train files disagree on cp_size {sorted(cp_sizes)}")
    cp_size = cp_sizes.pop()
    raw_reward = next((d["raw_reward"] for _, _, _, d in packs if d.get("raw_reward") is not None), None)
    where_sample: dict[int, list[tuple[int, Path, dict, dict, int]]] = {}
    for rank, path, pack, data in packs:
        for row, index in enumerate(data["sample_indices"]):
            if index is None:
                raise ImportFormatError(f"{path}[rollout_data]['sample_indices'][{row}]: None; the samples carry "
                                        f"no Sample.index to join the rollout dump by")
            where_sample.setdefault(int(index), []).append((rank, path, pack, data, row))
    rows: dict[int, dict[str, Any]] = {}
    for index, locations in where_sample.items():
        rank, path, pack, data, row = locations[0]
        total, resp = int(data["total_lengths"][row]), int(data["response_lengths"][row])
        for _, o_path, _, o_data, o_row in locations[1:]:
            if int(o_data["total_lengths"][o_row]) != total or int(o_data["response_lengths"][o_row]) != resp:
                raise ImportFormatError(f"{o_path}: sample {index} has lengths ({o_data['total_lengths'][o_row]}, "
                                        f"{o_data['response_lengths'][o_row]}), {path} has ({total}, {resp})")
        entry: dict[str, Any] = {"rank": rank, "where": f"{path}[rollout_data] sample_index {index}",
                                 "tokens": _array(data["tokens"][row], f"{path}[tokens][{row}]", np.int64),
                                 "total_length": total, "response_length": resp}
        if data.get("loss_masks") is not None:
            entry["loss_mask"] = _array(data["loss_masks"][row], f"{path}[loss_masks][{row}]", np.float32)
        if has_cp_rank:
            sample_cp, cp_of = cp_size, {id(l_pack): int(l_pack["cp_rank"]) for _, _, l_pack, _, _ in locations}
        else:
            sample_cp, cp_of = _legacy_cp_layout(locations, total, resp, f"{path.parent}/{rid}_*.pt "
                                                                          f"sample_index {index}")
        max_seq = data.get("max_seq_lens")
        max_seq_len = int(max_seq[row]) if pack.get("qkv_format") == "bshd" and max_seq is not None else None
        if sample_cp > 1 and pack.get("qkv_format") == "bshd" and max_seq_len is None:
            raise ImportFormatError(f"{path}[rollout_data]['max_seq_lens']: missing, needed to place the bshd "
                                    f"context-parallel slices")
        for field in CP_FIELDS:
            chunks: dict[int, np.ndarray] = {}
            for _, l_path, l_pack, l_data, l_row in locations:
                if l_data.get(field) is None:
                    continue  # pipeline stages before the last compute no trainer fields
                # setdefault: tensor-parallel peers hold copies of the same slice
                chunks.setdefault(cp_of[id(l_pack)],
                                  _array(l_data[field][l_row], f"{l_path}[{field}][{l_row}]", np.float32))
            if not chunks:
                continue
            key = f"{path.parent}/{rid}_*.pt[{field}] sample_index {index}"
            value = (next(iter(chunks.values())) if sample_cp == 1
                     else assemble_cp(chunks, total, resp, sample_cp, key, max_seq_len))
            if len(value) != resp:
                raise ImportFormatError(f"{key}: {len(value)} value(s) for a {resp}-token response")
            entry[field] = value
        rows[index] = entry
    layout = (f"per-rank train dump, cp_rank recorded (cp_size {cp_size})" if has_cp_rank
              else "per-rank train dump without cp_rank (CP layout recovered from the slices)")
    return rows, raw_reward, layout


def _train_rows_single(files: list[tuple[int, Path]], rid: int, rollout_samples: list[dict], allow_pickle: bool
                       ) -> tuple[dict[int, dict[str, Any]], Any, str]:
    """The same from slime's single-file format 2 (CP fields already full length), keyed by ``Sample.index``."""
    (_, path), = files
    pack = load_pt(path, allow_pickle)
    version = _get(pack, "format_version", str(path))
    if version != 2:
        raise ImportFormatError(f"{path}: format_version {version!r}, this importer reads slime's format 2")
    if _get(pack, "rollout_id", str(path)) != rid:
        raise ImportFormatError(f"{path}: rollout_id {pack['rollout_id']!r}, the file name says {rid}")
    rows: dict[int, dict[str, Any]] = {}
    for i, sample in enumerate(_get(pack, "samples", str(path))):
        where = f"{path}[samples][{i}]"
        position = sample.get("rollout_position")
        if position is not None:
            if not 0 <= int(position) < len(rollout_samples):
                raise ImportFormatError(f"{where}: rollout_position {position} outside the rollout dump's "
                                        f"{len(rollout_samples)} samples")
            own = rollout_samples[int(position)].get("index")  # read() keys samples without one by position
            index = int(own) if own is not None else int(position)
        elif sample.get("sample_index") is not None:
            index = int(sample["sample_index"])
        else:
            raise ImportFormatError(f"{where}: neither rollout_position nor sample_index; the sample cannot be "
                                    f"joined to the rollout dump")
        resp = int(_get(sample, "response_lengths", where))
        entry: dict[str, Any] = {"rank": int(sample.get("data_parallel_rank", 0)), "where": where,
                                 "tokens": _array(_get(sample, "tokens", where), f"{where}['tokens']", np.int64),
                                 "total_length": int(_get(sample, "total_lengths", where)), "response_length": resp}
        if sample.get("loss_masks") is not None:
            entry["loss_mask"] = _array(sample["loss_masks"], f"{where}['loss_masks']", np.float32)
        for field in CP_FIELDS:
            if sample.get(field) is not None:
                entry[field] = _array(sample[field], f"{where}[{field!r}]", np.float32)
        rows[index] = entry
    return rows, pack.get("raw_reward"), "train dump format_version 2 (single file)"


def routed_experts(value: Any, total: int, resp: int, where: str) -> np.ndarray | None:
    """``Sample.rollout_routed_experts`` (``(total - 1, L, k)``: one row per position fed) cut to the rows that
    predict the ``resp`` response tokens, ``(resp, L, k)`` int16; None when the sample has none. ImportFormatError
    naming the field, its shape and the one expected, for another shape or non-integer ids."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    label = f"{where}['rollout_routed_experts']"
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as err:
        raise ImportFormatError(f"{label}: not an array of expert ids ({err})") from None
    if arr.ndim != 3 or arr.shape[0] != total - 1 or total - resp < 1:
        raise ImportFormatError(f"{label} has shape {arr.shape}, expected ({total - 1}, MoE layers, top-k): one row "
                                f"per position fed, len(tokens) - 1 for {total} tokens with a {resp}-token response")
    if arr.dtype.kind not in "iu":
        raise ImportFormatError(f"{label} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.size and not -1 <= arr.min() <= arr.max() <= np.iinfo(np.int16).max:
        bad = arr[(arr < -1) | (arr > np.iinfo(np.int16).max)][0]
        raise ImportFormatError(f"{label}: expert id {int(bad)} (ids are >= 0, -1 the writers' filler)")
    return arr[total - resp - 1: total - 1].astype(np.int16)


def _sequence(step: int, sample: dict, position: int, train: dict[str, Any], raw_reward: Any,
              rollout_where: str) -> Sequence:
    where = train["where"]
    resp, total = train["response_length"], train["total_length"]
    tokens = train["tokens"]
    if len(tokens) != total:
        raise ImportFormatError(f"{where}: tokens has {len(tokens)} ids, total_lengths says {total}")
    if int(sample.get("response_length", resp)) != resp:
        raise ImportFormatError(f"{rollout_where}: response_length {sample.get('response_length')} but the train "
                                f"dump has {resp} ({where})")
    mu = sample.get("rollout_log_probs")
    mu = _array(mu, f"{rollout_where}['rollout_log_probs']", np.float32) if mu is not None else train.get(
        "rollout_log_probs")
    if mu is None:
        raise ImportFormatError(f"{rollout_where}['rollout_log_probs']: missing on both sides; the engine's "
                                f"log-probs are needed as mu")
    train_mu = train.get("rollout_log_probs")
    if train_mu is not None and len(train_mu) == len(mu) == resp:
        # both sides carry the engine's log-probs: they must agree, or the join paired the wrong samples
        # (tolerance for the bf16 copy of --true-on-policy-mode)
        scored = np.isfinite(mu) & np.isfinite(train_mu)
        off = scored & ~np.isclose(train_mu, mu, rtol=1e-2, atol=1e-2)
        if off.any():
            p = int(np.flatnonzero(off)[0])
            raise ImportFormatError(f"{where}: rollout_log_probs[{p}] = {float(train_mu[p])} but {rollout_where} "
                                    f"has {float(mu[p])}: the train and rollout dumps do not pair")
    if "log_probs" not in train:
        raise ImportFormatError(f"{where}['log_probs']: missing: the dump has no trainer log-prob "
                                f"(the run used rollout log-probs without computing its own)")
    if "advantages" not in train:
        raise ImportFormatError(f"{where}['advantages']: missing")
    if "loss_mask" in train:
        loss_mask = train["loss_mask"]
    elif sample.get("loss_mask") is not None:
        loss_mask = _array(sample["loss_mask"], f"{rollout_where}['loss_mask']", np.float32)
    else:
        loss_mask = np.ones(resp, dtype=np.float32)
    for name, arr in (("rollout_log_probs", mu), ("loss_mask", loss_mask), *((f, train[f]) for f in
                      ("log_probs", "advantages", "entropy") if f in train)):
        if len(arr) != resp:
            raise ImportFormatError(f"{where}: {name} has {len(arr)} value(s) for a {resp}-token response")
    removed = bool(sample.get("remove_sample", False))
    group = sample.get("group_index")
    first, last = weight_versions(sample.get("weight_versions"), step, f"{rollout_where}['weight_versions']")
    return Sequence(
        step=step, rank=train["rank"], where=where,
        token_id=tokens[total - resp:], mu_logprob=mu, pi_logprob=train["log_probs"],
        old_logprob=train["log_probs"], advantage=train["advantages"], entropy=train.get("entropy"),
        mask=loss_mask > 0, kept=np.full(resp, not removed),
        prompt_key=("group", int(group)) if group is not None else tuple(tokens[: total - resp].tolist()),
        sample_id=int(sample["index"]) if sample.get("index") is not None else None,
        prompt=_prompt_text(sample.get("prompt")),
        response=sample.get("response") if isinstance(sample.get("response"), str) else None,
        reward=_reward(sample, raw_reward, position),
        finish_reason=str(sample["status"]) if sample.get("status") is not None else None,
        engine_experts=routed_experts(sample.get("rollout_routed_experts"), total, resp, rollout_where),
        policy_version=first, policy_version_last=last,
    )


def weight_versions(value: Any, step: int, where: str) -> tuple[int | None, int | None]:
    """``Sample.weight_versions`` (the SGLang engine's ``weight_version`` of each generation call of the sample, in
    order, as strings) -> ``(policy_version, policy_version_last)`` in trainer steps, or ``(None, None)`` when the
    dump has none.

    slime and miles push the weights once before rollout 0 (version 1) and once after each rollout's training
    (``train.py``, ``train_async.py`` with ``--update-weights-interval 1``, the default), so version ``v`` holds
    the weights after ``v - 1`` training steps: the policy version is ``v - 1``. A version that is not an integer,
    or that maps outside ``[0, step]``, is refused naming the sample and the value. Limits: a run that pushes
    less often (``--update-weights-interval`` > 1) or that resumed without carrying its count on
    (``--update-weight-start-version``) numbers fewer pushes than steps, and reads staler than it was."""
    if value is None or (hasattr(value, "__len__") and len(value) == 0):
        return None, None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ImportFormatError(f"{where}: {value!r} is not a list of weight versions")
    steps = []
    for v in value:
        try:
            number = int(str(v).strip())
        except ValueError:
            raise ImportFormatError(f"{where}: weight version {v!r} is not an integer (slime's engines number "
                                    f"their weight pushes 1, 2, ...)") from None
        if not 1 <= number <= step + 1:
            raise ImportFormatError(f"{where}: weight version {v!r} is not a push before rollout {step}: slime's "
                                    f"version v holds the weights after v - 1 training steps, so 1 <= v <= "
                                    f"{step + 1}")
        steps.append(number - 1)
    return steps[0], steps[-1]


def finished_steps(src: Path, settle_s: float, now: float) -> Listing:
    """The rollouts of a running job's dump and those it finished (``--follow``): ``torch.save`` writes straight
    to ``rollout_data/<id>.pt`` and ``train_data/<id>[_<rank>].pt`` (no rename, so a file may be half written):
    a rollout is finished once both sides exist and a later rollout has train data, or none of its files has
    changed for ``settle_s``."""
    if not src.is_dir():
        raise SourceGone(f"{src}: not a directory (expected a --dump-details directory)")
    rollouts: dict[int, Path] = {}
    if (src / "rollout_data").is_dir():
        for p in (src / "rollout_data").iterdir():
            if m := _ROLLOUT_FILE.match(p.name):
                rollouts[int(m.group(1))] = p
    trains: dict[int, list[Path]] = {}
    if (src / "train_data").is_dir():
        for p in (src / "train_data").iterdir():
            if m := _TRAIN_FILE.match(p.name):
                trains.setdefault(int(m.group(1)), []).append(p)
    finished = set()
    for rid, path in rollouts.items():
        if rid not in trains:
            continue
        later = any(other > rid for other in trains)
        if later or now - max(p.stat().st_mtime for p in (path, *trains[rid])) >= settle_s:
            finished.add(rid)
    return Listing(frozenset(rollouts), frozenset(finished))


@register_importer("slime", reads="a --dump-details directory: rollout_data/ and train_data/ .pt files",
                   options=ALLOW_PICKLE, finished=finished_steps)
def read_slime(src: Path, *, version: str | None = None, steps: Collection[int] | None = None,
               allow_pickle: bool = False) -> ImportedRun:
    """slime's ``--dump-details`` directory."""
    return read(src, version=version, framework="slime", steps=steps, allow_pickle=allow_pickle)


@register_importer("miles", reads="the same for miles (per-rank train files, context-parallel slices joined)",
                   options=ALLOW_PICKLE, finished=finished_steps)
def read_miles(src: Path, *, version: str | None = None, steps: Collection[int] | None = None,
               allow_pickle: bool = False) -> ImportedRun:
    """miles' ``--dump-details`` directory."""
    return read(src, version=version, framework="miles", steps=steps, allow_pickle=allow_pickle)


def read(src: str | Path, *, version: str | None = None, framework: str = "slime",
         steps: Collection[int] | None = None, allow_pickle: bool = False) -> ImportedRun:
    """Parse, join and check every rollout step of a ``--dump-details`` directory (of ``steps`` when given); see
    the module docstring."""
    src = Path(src)
    rollouts, trains = _rollout_files(src), _train_files(src)
    if steps is not None:
        rollouts = {rid: p for rid, p in rollouts.items() if rid in steps}
        trains = {rid: t for rid, t in trains.items() if rid in steps}
    for rid in sorted(set(trains) - set(rollouts)):
        raise ImportFormatError(f"{trains[rid][1][0][1]}: no rollout_data/{rid}.pt to join it with")
    sequences: list[Sequence] = []
    writer = SameThroughout(MIXED)  # the train dump's layout, without its cp_size
    layouts: dict[str, int] = {}
    n_files = 0
    for rid in sorted(rollouts):
        path = rollouts[rid]
        if rid not in trains:
            raise ImportFormatError(f"{path}: no train_data for rollout {rid} (the step did not finish training; "
                                    f"remove the file to import the steps before it)")
        pack = load_pt(path, allow_pickle)
        if _get(pack, "rollout_id", str(path)) != rid:
            raise ImportFormatError(f"{path}: rollout_id {pack['rollout_id']!r}, the file name says {rid}")
        samples = _get(pack, "samples", str(path))
        kind, files = trains[rid]
        if kind == "single":
            rows, raw_reward, layout = _train_rows_single(files, rid, samples, allow_pickle)
        else:
            rows, raw_reward, layout = _train_rows_per_rank(files, rid, allow_pickle)
        writer.check(layout.split(" (")[0], str(files[0][1]))
        layouts.setdefault(layout, rid)
        n_files += 1 + len(files)
        by_index = {}
        for position, sample in enumerate(samples):
            where = f"{path}[samples][{position}]"
            index = _get(sample, "index", where)
            by_index[int(index) if index is not None else position] = (position, sample, where)
        for index in rows:
            if index not in by_index:
                raise ImportFormatError(f"{rows[index]['where']}: sample_index {index} is not in {path}")
        for index, train in sorted(rows.items()):
            position, sample, where = by_index[index]
            sequences.append(_sequence(rid, sample, position, train, raw_reward, where))
    layout = "; ".join(layouts)
    routing = SameThroughout("routed experts of two models are mixed",
                             lambda lk: f"routed experts of (MoE layers, top-k) {lk}")
    for seq in sequences:
        if seq.engine_experts is not None:
            routing.check(seq.engine_experts.shape[1:], seq.where)
    notes = dict(NOTES) | ({"engine_experts": ROUTING_NOTE} if routing.value is not None else {})
    return ImportedRun(
        framework=framework, version=version or f"unknown ({layout})", format=f"{framework} --dump-details, {layout}",
        src=src, loss_rule=framework, notes=notes, sequences=sequences, files=n_files,
        routing=None if routing.value is None else tuple(int(x) for x in routing.value),
    )
