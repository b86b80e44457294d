"""Import prime-rl's trainer token export (``token_exports/step_<N>/rank_<R>.jsonl``).

Writer: ``src/prime_rl/trainer/rl/token_export.py`` of PrimeIntellect-ai/prime-rl, ``TokenExporter.export`` and
``_export_columns`` (switched on by ``trainer.enable_token_export``; called from ``trainer/rl/train.py`` after each
micro-batch's forward). One JSON object per line, ``json.dumps(record, separators=(",", ":"), allow_nan=False)``,
one line per packed sequence that has at least one ``loss_mask`` token. Every per-token list is aligned with
``token_ids`` (prompt and completion of one packed sample, trailing padding trimmed): ``trainer_logprobs`` and
``entropy`` are shifted right by the trainer so that index t scores ``token_ids[t]``, like
``inference_logprobs``. Non-finite floats and absent tensors are written as ``null``. ``STABLE`` is touched in a
step directory once every rank has flushed it.

Layouts read (all ``schema_version`` 1; the version number never changed, the field set did):

- *training-mode* (prime-rl #2592, May 2026, to #2746): ``training_mode`` per record and a per-token ``rewards``
  list; ``export_step`` / ``run_id`` from #2641 on.
- *weight-stream* (#2746, June 2026, and later): the component weight streams ``rl_weights``, ``ce_weights``,
  ``ref_kl_weights`` (``null`` lists mean the defaults: rl weight 1 on the loss mask) replace ``training_mode``
  and ``rewards``; ``export_step`` / ``run_id`` until #3189 (multi-tenant removed).
- *loss-channel* (the loss-channel branch, #2859): a per-token ``losses`` list of ``{loss: {"advantage", "mask"}}``
  (``advantages`` is the ``rl`` channel's values, the loss mask the union of the channels' masks), per-token
  ``rewards``, no ``training_mode``; a named run writes ``output_dir/<run_id>/token_exports/step_<run step>``,
  steps from 0. Rows where the ``rl`` channel trains the token.

A file mixing layouts is refused naming the file and line. Fields a layout does not have (a newer or forked
prime-rl) are kept as the run's own columns where a column takes them, or left out, and named once
(:func:`~trustscope.importers.base.keep_unknown`); a record without a field trustscope reads (:data:`REQUIRED`, or
the field that tells the layouts apart) is refused naming the file and line. The per-token lists no column is made
of are skipped unparsed by the fast decoder (:func:`_decoder`) and their lengths are not checked.

Mapping: ``token_id`` = ``token_ids`` from the first ``loss_mask`` position to the last (``pos`` 0 = the first
trained token; multi-turn environment tokens in between keep their positions but are not rows); ``mu_logprob`` =
``inference_logprobs`` (the inference server's); ``pi_logprob`` = ``trainer_logprobs``, the trainer's log-prob
from the forward pass the loss is computed on. prime-rl takes one optimizer step per batch, so this is also the
policy before the update: no separate ``old_logprob`` exists and none is imported. ``advantage`` =
``advantages``; ``entropy`` = ``entropy``; ``kept`` = not ``is_masked`` (the DPPO mask of prime-rl's default
loss, ``null`` under other losses, then every token reads kept); rows only where ``loss_mask`` is true and (in
the weight-stream layout) the rl weight is not 0 (tokens trained by cross-entropy alone have no sampling
log-prob). ``prompt_id`` groups the sequences of a step with the same prompt token ids. The samples table gets
the sampled sequences; the export decodes nothing, so text comes from the trace streams below (``reward`` is also
in the training-mode layout).

When ``SRC`` is the run directory (``output_dir / run.name``, shared by trainer and orchestrator), two more files
are read:

- the orchestrator's trace streams ``rollouts/step_<N>/train/{all,effective}/traces.jsonl``: writer
  ``src/prime_rl/monitors/file.py`` ``FileMonitor.log_episodes``, one ``orjson`` line per episode,
  ``verifiers.v1.Episode.to_record()`` (PrimeIntellect-ai/verifiers ``verifiers/v1/episode.py``; the trace record of
  ``verifiers/v1/trace.py``, ``version`` 1, with its message graph of ``verifiers/v1/graph.py`` ``MessageNode``:
  ``parent``, ``message``, ``sampled``, ``token_ids``, ``mask``, ``logprobs``, ``advantages``). Each root-to-leaf
  branch's concatenated ``token_ids`` is exactly the packed sample the trainer exported, so branches are joined
  to export sequences by token ids, giving the prompt text (the messages before the first sampled one), the
  response text (the sampled messages), the reward (the sum of ``score * weight`` of ``rewards``),
  ``finish_reason`` (``stop_condition``) and the GRPO group (``group.id``, as ``prompt_id``). A trace of another
  record version, or traces of two verifiers versions, are refused.
- ``metrics.jsonl`` (``FileMonitor.log_metrics``: ``{"step", "time", **metrics}`` per line, non-finite values
  already dropped by the writer): every number becomes a scalar of the steps table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from trustscope.importers.base import (
    ImportedRun,
    ImportFormatError,
    Listing,
    SameThroughout,
    Sequence,
    floats,
    ints,
    json_lines,
    keep_unknown,
    loads,
    merge_unknown,
    raw_lines,
    register_importer,
)

META = ("schema_version", "step", "rank", "micro_step", "micro_sequence_idx", "export_sequence_idx", "env_name")
TOKEN_LISTS = ("token_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "trainer_logprobs",
               "entropy", "mismatch_kl", "log_importance_ratio", "importance_ratio", "prob_delta", "is_masked",
               "is_masked_high", "is_masked_low")
LAYOUTS = {
    "training-mode": frozenset({*META, *TOKEN_LISTS, "training_mode", "rewards"}),
    "weight-stream": frozenset({*META, *TOKEN_LISTS, "rl_weights", "ce_weights", "ref_kl_weights"}),
    "loss-channel": frozenset({*META, *TOKEN_LISTS, "losses", "rewards"}),
}
MARKERS = {"training-mode": "training_mode", "weight-stream": "rl_weights", "loss-channel": "losses"}
"""The field that tells each layout apart."""
REQUIRED = frozenset({"schema_version", "step", "rank", "token_ids", "loss_mask", "advantages", "inference_logprobs",
                      "trainer_logprobs", "entropy"})
"""What every record must hold, whatever its layout: the fields trustscope's rows are made of."""
OPTIONAL = frozenset({"export_step", "run_id"})  # multi-tenant exports (#2641 to #3189)
SCHEMA_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RANK_FILE = re.compile(r"^rank_(\d+)\.jsonl$")

NOTES = {
    "mu_logprob": "inference_logprobs (the inference server's log-prob of the sampled token)",
    "pi_logprob": "trainer_logprobs: the trainer's log-prob in the loss's forward pass (one optimizer step per "
                  "batch, so also the pre-update policy; no separate pi_old exists)",
    "old_logprob": "not exported by prime-rl (null)",
    "advantage": "advantages (per token)",
    "entropy": "entropy (the trainer's, at the loss's temperature)",
    "kept": "not is_masked (the DPPO mask of prime-rl's default loss; all kept when the loss exports none)",
    "rows": "loss_mask tokens with a non-zero rl weight, from the first loss_mask token on",
}


def run_dir_of(src: Path) -> Path:
    """The run directory under ``src``: ``src`` itself, or the one ``<run_id>/`` below it that holds a
    ``token_exports/`` (prime-rl writes a named run's export to ``output_dir/<run_id>/token_exports/``: pointed at
    ``output_dir``, the run is found). Several runs there are refused, naming them."""
    if not src.is_dir() or (src / "token_exports").is_dir() or step_dirs(src):
        return src
    runs = sorted(p for p in src.iterdir() if (p / "token_exports").is_dir())
    if len(runs) > 1:
        raise ImportFormatError(f"{src}: holds the token exports of {len(runs)} runs ({', '.join(p.name for p in runs)}); "
                                f"import one at a time: point at {src}/<run_id>")
    return runs[0] if runs else src


def export_root(src: Path) -> Path:
    """The ``token_exports`` directory of ``src`` (that directory itself, the trainer output directory, or the
    output directory holding one named run: :func:`run_dir_of`)."""
    src = run_dir_of(src)
    root = src / "token_exports" if (src / "token_exports").is_dir() else src
    if not root.is_dir():
        raise ImportFormatError(f"{src}: not a directory (expected prime-rl's token_exports/ or its parent)")
    return root


def step_dirs(root: Path) -> dict[int, Path]:
    """``{step: step_<N> directory}`` of a ``token_exports`` directory."""
    out = {}
    for step_dir in root.iterdir():
        m = _STEP_DIR.match(step_dir.name)
        if m and step_dir.is_dir():
            out[int(m.group(1))] = step_dir
    return out


def export_files(src: Path, steps: Collection[int] | None = None) -> list[tuple[int, int, Path]]:
    """``(step, rank, path)`` of every ``step_<N>/rank_<R>.jsonl`` under ``src`` (a ``token_exports`` directory or
    the trainer output directory holding one), sorted by step and rank; only of ``steps`` when given."""
    root = export_root(src)
    found = []
    for step, step_dir in step_dirs(root).items():
        if steps is not None and step not in steps:
            continue
        for path in step_dir.iterdir():
            r = _RANK_FILE.match(path.name)
            if r:
                found.append((step, int(r.group(1)), path))
    if not found:
        raise ImportFormatError(f"{root}: no step_<N>/rank_<R>.jsonl files (prime-rl token export)")
    stable = {path.parent for _, _, path in found if (path.parent / "STABLE").exists()}
    if stable:  # writers since #2641 mark every finished step; one without the marker was cut short
        for _, _, path in sorted(found):
            if path.parent not in stable:
                raise ImportFormatError(f"{path.parent}: no STABLE marker while other steps have one: the step was "
                                        f"not finished by every rank (still running, or the trainer died)")
    return sorted(found)


TRACE_VERSION = 1  # verifiers.v1.trace.TRACE_VERSION
_TRACE_FILE = re.compile(r"^step_(\d+)/train/(all|effective)/traces\.jsonl$")


@dataclass
class _Branch:
    """What the trace stream says of one trained sequence."""

    prompt: str | None
    response: str | None
    reward: float | None
    finish_reason: str | None
    group: str | None


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _branches(trace: dict, where: str) -> list[tuple[tuple[int, ...], list[dict]]]:
    """``(token ids, nodes)`` of each root-to-leaf path of a trace's message graph."""
    nodes = trace.get("nodes")
    if not isinstance(nodes, list):
        raise ImportFormatError(f"{where}: trace 'nodes' must be a list")
    parents = set()
    for i, node in enumerate(nodes):
        parent = node.get("parent") if isinstance(node, dict) else "bad"
        if parent is not None and not (isinstance(parent, int) and 0 <= parent < i):
            raise ImportFormatError(f"{where}: node {i} has parent {parent!r}; parents come before their children")
        parents.add(parent)
    out = []
    for leaf in (i for i in range(len(nodes)) if i not in parents):
        path, nid = [], leaf
        while nid is not None:
            path.append(nodes[nid])
            nid = nodes[nid].get("parent")
        path.reverse()
        ids: list[int] = []
        for node in path:
            ids.extend(node.get("token_ids") or [])
        out.append((tuple(ids), path))
    return out


def _trace_branch(episode: dict, trace: dict, path: list[dict]) -> _Branch:
    first = next((i for i, n in enumerate(path) if n.get("sampled")), len(path))
    rewards = [r for r in (trace.get("rewards") or {}).values() if isinstance(r, dict)]
    group = episode.get("group")
    return _Branch(
        prompt="\n".join(_text(n.get("message")) for n in path[:first]) or None,
        response="\n".join(_text(n.get("message")) for n in path[first:] if n.get("sampled")) or None,
        reward=sum(float(r["score"]) * float(r.get("weight", 1.0)) for r in rewards) if rewards else None,
        finish_reason=trace.get("stop_condition"),
        group=str(group["id"]) if isinstance(group, dict) and "id" in group else None,
    )


def trace_index(run_dir: Path, steps: Collection[int] | None = None
                ) -> tuple[dict[tuple[int, ...], _Branch], str | None, int]:
    """Branches of every train trace stream under ``run_dir/rollouts`` (of ``steps`` when given: the orchestrator
    may still be appending, so each file ends at its last complete line), keyed by their token ids; the verifiers
    version that wrote them; the number of files read."""
    root = run_dir / "rollouts"
    found = (root.rglob("traces.jsonl") if steps is None else  # a step's own directory, not the whole tree
             (p for n in steps for p in (root / f"step_{n}" / "train").glob("*/traces.jsonl")))
    files = sorted(p for p in found if (m := _TRACE_FILE.match(p.relative_to(root).as_posix()))
                   and (steps is None or int(m.group(1)) in steps))
    index: dict[tuple[int, ...], _Branch] = {}
    versions = SameThroughout("trace streams of two verifiers versions are mixed", "written by verifiers {}".format)
    for path in files:
        for line, episode in json_lines(path, partial_tail=steps is not None):
            where = f"{path}:{line}"
            traces = episode.get("traces") if isinstance(episode, dict) else None
            if not isinstance(traces, list):
                raise ImportFormatError(f"{where}: an episode record needs a 'traces' list")
            for trace in traces:
                if not isinstance(trace, dict) or trace.get("version") != TRACE_VERSION:
                    got = trace.get("version") if isinstance(trace, dict) else trace
                    raise ImportFormatError(f"{where}: trace record version {got!r}, this importer reads "
                                            f"{TRACE_VERSION}")
                versions.check(str((trace.get("verifiers") or {}).get("version")), where)
                for ids, path_nodes in _branches(trace, where):
                    index.setdefault(ids, _trace_branch(episode, trace, path_nodes))
    return index, versions.value, len(files)


def step_scalars(path: Path, steps: Collection[int] | None = None) -> dict[int, dict[str, float]]:
    """``{step: {name: value}}`` from prime-rl's ``metrics.jsonl`` (numbers only; later lines win); only of
    ``steps`` when given (the file is still being appended to: it ends at its last complete line)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, steps is not None)
    if _METRICS.get("key") != key:  # one parse per version of the file, however many steps ask for theirs
        out: dict[int, dict[str, float]] = {}
        for line, row in json_lines(path, partial_tail=steps is not None):
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ImportFormatError(f"{path}:{line}: a metrics row needs an integer 'step'")
            values = {k: float(v) for k, v in row.items() if k not in ("step", "time")
                      and isinstance(v, (int, float)) and not isinstance(v, bool)}
            out.setdefault(row["step"], {}).update(values)
        _METRICS.update(key=key, rows=out)
    rows = _METRICS["rows"]
    return {n: dict(v) for n, v in rows.items() if steps is None or n in steps}


_METRICS: dict[str, Any] = {}
"""The last ``metrics.jsonl`` parsed (its path, size and mtime) and its rows: a source read step by step parses
it once, not once a step."""


def _layout(record: Any, where: str) -> tuple[str, tuple[str, ...]]:
    """The record's layout and its fields that layout does not have (an export of a newer or forked prime-rl:
    read on, the fields kept as the run's own columns where a column takes them, and named once). A record
    without a field trustscope reads is refused."""
    if not isinstance(record, dict):
        raise ImportFormatError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    keys = set(record) - OPTIONAL
    for name, fields in LAYOUTS.items():
        if keys == fields:
            return name, ()
    marked = [n for n, marker in MARKERS.items() if marker in keys]
    best = min(marked or LAYOUTS, key=lambda n: len(keys ^ LAYOUTS[n]))
    missing, extra = sorted(LAYOUTS[best] - keys), sorted(keys - LAYOUTS[best])
    if not marked or REQUIRED - keys or len(marked) > 1:
        raise ImportFormatError(f"{where}: fields match no known token-export layout (closest: {best}; "
                                f"missing {missing}, unknown {extra})")
    return best, tuple(extra)


def _bools(values: Any, where: str, name: str) -> np.ndarray | None:
    """A JSON list of booleans as ``(T,)`` bool; None when the writer exported none (a list of nulls)."""
    if not isinstance(values, list):
        raise ImportFormatError(f"{where}: {name!r} must be a list, got {type(values).__name__}")
    if not values or (values[0] is None and values.count(None) == len(values)):
        return None
    arr = np.array(values)
    if arr.dtype != np.bool_ or arr.ndim != 1:
        raise ImportFormatError(f"{where}: {name!r} must hold only booleans (or only nulls)")
    return arr


_LAYOUT_LISTS = {"training-mode": ("rewards",), "weight-stream": ("rl_weights", "ce_weights", "ref_kl_weights"),
                 "loss-channel": ("losses", "rewards")}


def _rl_channel(losses: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``rl`` loss channel of a loss-channel record's per-token ``losses`` (``{loss: {"advantage", "mask"}}``
    per token): ``(T,)`` bool where the rl loss trains the token, ``(T,)`` float32 its advantage (NaN elsewhere)."""
    mask = np.zeros(len(losses), dtype=bool)
    adv = np.full(len(losses), np.nan, dtype=np.float32)
    for t, channels in enumerate(losses):
        if not isinstance(channels, dict):
            raise ImportFormatError(f"{where}: 'losses'[{t}] must be an object of loss channels, got {channels!r}")
        rl = channels.get("rl")
        if isinstance(rl, dict) and rl.get("mask") is True:
            mask[t] = True
            value = rl.get("advantage")
            adv[t] = np.nan if value is None else float(value)
    return mask, adv


_READ_LISTS = {"token_ids": list[int], "loss_mask": list[bool | None], "is_masked": list[bool | None],
               **{name: list[float | None] for name in ("advantages", "inference_logprobs", "trainer_logprobs",
                                                        "entropy", "rewards", "rl_weights")}}
"""The per-token lists trustscope reads (``losses`` too), as the fast decoder types them (a record holding
anything else there is parsed whole, and refused as a whole parse refuses it)."""
_UNREAD_LISTS = frozenset(TOKEN_LISTS) - set(_READ_LISTS) | {"ce_weights", "ref_kl_weights"}
"""Per-token lists no column is made of: skipped unparsed by the fast decoder, their lengths not checked."""
_DECODERS: dict[frozenset[str], Any] = {}


def _decoder(keys: frozenset[str]) -> Any:
    """A decoder of records with exactly the fields ``keys``: the per-token lists trustscope reads typed, the
    lists it does not read skipped (left as ``msgspec.Raw``), everything else as JSON values. A record with other
    fields or types fails it. About half the work of parsing every list of a record into Python objects."""
    if keys not in _DECODERS:
        fields = [(k, _READ_LISTS.get(k, msgspec.Raw if k in _UNREAD_LISTS else Any)) for k in sorted(keys)]
        _DECODERS[keys] = msgspec.json.Decoder(msgspec.defstruct("Record", fields, forbid_unknown_fields=True))
    return _DECODERS[keys]


def _records(path: Path) -> Any:
    """``(line, record)`` of each line of an export file, a record a dict of its fields: by the fast decoder of
    the key set the line before had (:func:`_decoder`), else parsed whole
    (:func:`~trustscope.importers.base.loads`), which names the line when it is not JSON."""
    decoder = None
    for line, raw in raw_lines(path):
        if decoder is not None:
            try:
                struct = decoder.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            else:
                yield line, msgspec.structs.asdict(struct)
                continue
        record = loads(raw, f"{path}:{line}")
        decoder = _decoder(frozenset(record)) if isinstance(record, dict) else None
        yield line, record


def _sequence(record: dict, layout: str, step: int, rank: int, where: str, run: ImportedRun,
              extra: Collection[str]) -> Sequence | None:
    """One record's sequence (None: nothing the rl loss trains); its fields ``extra`` (unknown to its layout)
    kept on it and noted in ``run`` (:func:`~trustscope.importers.base.keep_unknown`)."""
    n = len(record["token_ids"]) if isinstance(record["token_ids"], list) else -1
    for name in TOKEN_LISTS + _LAYOUT_LISTS[layout]:
        if name in _UNREAD_LISTS or (name not in record and name not in REQUIRED):  # not read, or not written
            continue
        value = record[name]
        if not isinstance(value, list) or len(value) != n:
            got = len(value) if isinstance(value, list) else type(value).__name__
            raise ImportFormatError(f"{where}: {name!r} has length {got}, 'token_ids' has {n}")
    token_ids = ints(record["token_ids"], where, "token_ids")
    loss_mask = _bools(record["loss_mask"], where, "loss_mask")
    if loss_mask is None or not loss_mask.any():
        raise ImportFormatError(f"{where}: no loss_mask token (the writer skips such sequences)")
    trained = loss_mask.copy()
    advantages = floats(record["advantages"], where, "advantages")
    if layout == "weight-stream":
        rl = floats(record.get("rl_weights", [None] * n), where, "rl_weights")
        trained &= np.where(np.isnan(rl), 1.0, rl) != 0  # null = the default rl weight 1
    elif layout == "loss-channel":  # rows where the rl loss trains the token; its advantage is the channel's
        rl_mask, rl_adv = _rl_channel(record["losses"], where)
        trained &= rl_mask
        advantages = np.where(np.isnan(advantages), rl_adv, advantages)
        if not trained.any():
            return None  # trained by other losses only (no sampling log-prob is needed there)
    elif record["training_mode"] == "sft":
        return None
    idx = np.flatnonzero(loss_mask)
    first, end = int(idx[0]), int(idx[-1]) + 1
    span = slice(first, end)
    is_masked = _bools(record["is_masked"], where, "is_masked") if "is_masked" in record else None
    reward = None
    if layout in ("training-mode", "loss-channel") and "rewards" in record:
        rewards = floats(record["rewards"], where, "rewards")[loss_mask]
        finite = rewards[np.isfinite(rewards)]
        reward = float(finite[0]) if finite.size else None
    seq = Sequence(
        step=step, rank=rank, where=where,
        token_id=token_ids[span],
        mu_logprob=floats(record["inference_logprobs"], where, "inference_logprobs")[span],
        pi_logprob=floats(record["trainer_logprobs"], where, "trainer_logprobs")[span],
        advantage=advantages[span],
        entropy=floats(record["entropy"], where, "entropy")[span],
        mask=trained[span],
        kept=None if is_masked is None else ~is_masked[span],
        prompt_key=tuple(token_ids[:first].tolist()),
        reward=reward,
        full_ids=token_ids,
    )
    if extra:
        keep_unknown(run, seq, record, extra, n, span, where)
    return seq


@dataclass
class Stats:
    """What a prime-rl source held, added up over its steps (:func:`combine`)."""

    layout: str
    where: str  # the first record of that layout
    any_mask: bool = False
    skipped_sft: int = 0
    sequences: int = 0
    matched: int | None = None  # sequences joined to a trace branch (None: no trace streams)
    verifiers: tuple[str, str] | None = None  # the trace streams' verifiers version, and where first seen
    version: str | None = None  # the version the caller gave
    files: int = 0  # export and trace files read
    metrics: bool = False  # metrics.jsonl gave scalars


def _describe(run: ImportedRun, stats: Stats) -> ImportedRun:
    """``run`` with the description of everything ``stats`` counted: format, version, notes, loss rule."""
    notes = dict(NOTES)
    fmt = f"prime-rl token_export schema_version {SCHEMA_VERSION}, {stats.layout} layout"
    if stats.matched is not None:
        notes["samples"] = (f"prompt, response, reward, finish_reason and group from rollouts/step_*/train/*/"
                            f"traces.jsonl, joined by token ids: {stats.matched} of {stats.sequences} sequences "
                            f"matched")
        fmt += (f"; trace streams (trace version {TRACE_VERSION}, verifiers "
                f"{stats.verifiers[0] if stats.verifiers else None})")
    if run.unknown:
        names = sorted(run.unknown)
        kept = [n for n in names if n in run.extra_types]
        notes["unread"] = (f"fields kept as the run's own columns: {', '.join(kept) or 'none'}; left out: "
                           f"{', '.join(n for n in names if n not in kept) or 'none'}")
        fmt += f" (and fields {names})"
    if not stats.any_mask:
        notes["kept"] = "all kept: the export carries no is_masked (the loss was not prime-rl's default)"
    if stats.skipped_sft:
        notes["skipped"] = f"{stats.skipped_sft} training_mode='sft' sequence(s) (no RL update)"
    return dataclasses.replace(
        run, format=fmt, notes=notes, stats=stats, files=stats.files + stats.metrics,
        version=stats.version or f"unknown (token_export schema_version {SCHEMA_VERSION}, {stats.layout} layout)",
        loss_rule="prime-rl:default" if stats.any_mask else "prime-rl")


def combine(so_far: ImportedRun, step: ImportedRun) -> ImportedRun:
    """The description of a source read step by step (:func:`~trustscope.importers.writer.write_steps`): the
    steps' layouts and trace versions must agree (refused naming both places, as in one read)."""
    a, b = so_far.stats, step.stats
    layouts = SameThroughout(MIXED_LAYOUTS, "{} layout".format)
    layouts.check(a.layout, a.where)
    layouts.check(b.layout, b.where)
    verifiers = a.verifiers or b.verifiers
    if a.verifiers and b.verifiers:
        traces = SameThroughout(MIXED_TRACES, "written by verifiers {}".format)
        traces.check(a.verifiers[0], a.verifiers[1])
        traces.check(b.verifiers[0], b.verifiers[1])
    matched = None if a.matched is None and b.matched is None else (a.matched or 0) + (b.matched or 0)
    stats = Stats(a.layout, a.where, a.any_mask or b.any_mask, a.skipped_sft + b.skipped_sft,
                  a.sequences + b.sequences, matched, verifiers, a.version, a.files + b.files,
                  a.metrics or b.metrics)
    merged = dataclasses.replace(so_far, sequences=[], scalars={},
                                 unknown=dict(so_far.unknown), extra_types=dict(so_far.extra_types),
                                 skipped=dict(so_far.skipped))
    merge_unknown(merged, step)
    return _describe(merged, stats)


def list_steps(src: Path) -> list[int]:
    """The steps of the export under ``src`` (refused as :func:`read` refuses: no files, an unfinished step)."""
    return sorted({step for step, _, _ in export_files(run_dir_of(Path(src)))})


MIXED_LAYOUTS = "exports of two prime-rl versions are mixed"
MIXED_TRACES = "trace streams of two verifiers versions are mixed"


def _take(record: Any, step: int, rank: int, where: str, run: ImportedRun,
          layouts: SameThroughout[str]) -> tuple[str, Sequence | None]:
    """The layout and the sequence of one record of ``step_<step>/rank_<rank>.jsonl``, checked."""
    layout, extra = _layout(record, where)
    layouts.check(layout, where)
    if record["schema_version"] != SCHEMA_VERSION:
        raise ImportFormatError(f"{where}: schema_version {record['schema_version']!r}, this importer "
                                f"reads {SCHEMA_VERSION}")
    record_step = record.get("export_step", record["step"])
    if record_step != step or record["rank"] != rank:
        raise ImportFormatError(f"{where}: record says step {record_step!r} rank {record['rank']!r}, "
                                f"the file is step_{step}/rank_{rank}.jsonl")
    return layout, _sequence(record, layout, step, rank, where, run, extra)


def finished_steps(src: Path, settle_s: float, now: float) -> Listing:
    """The steps of a running export and those its trainer finished (``--follow``): the trainer touches
    ``STABLE`` in ``token_exports/step_<N>/`` once every rank has flushed the step (``TokenExporter.mark_stable``,
    after a barrier); the step is taken ``settle_s`` after, for the trainer's ``metrics.jsonl`` row of the step.
    Exports of writers before ``STABLE`` existed (#2641): a step is finished once a later step's directory
    exists."""
    dirs = step_dirs(export_root(src))
    marked = {n for n, d in dirs.items() if (d / "STABLE").exists()}
    finished = set()
    for n, d in dirs.items():
        if n in marked:
            if now - (d / "STABLE").stat().st_mtime >= settle_s:
                finished.add(n)
        elif not marked and any(m > n for m in dirs):  # a writer from before STABLE: the next step began
            finished.add(n)
    return Listing(frozenset(dirs), frozenset(finished))


@register_importer("prime-rl", reads="token_exports/step_<N>/rank_<R>.jsonl (the trainer's token export), "
                                     "or the run directory holding it", steps=list_steps, combine=combine,
                   finished=finished_steps)
def read(src: Path, *, version: str | None = None, steps: Collection[int] | None = None) -> ImportedRun:
    """Parse and check every export file under ``src`` (of ``steps`` when given); see the module docstring for
    the mapping."""
    src = run_dir_of(Path(src))
    files = export_files(src, steps)
    run = ImportedRun(framework="prime-rl", version="", format="", src=src, loss_rule="", notes={})
    layouts = SameThroughout(MIXED_LAYOUTS, "{} layout".format)
    stats: Stats | None = None
    for step, rank, path in files:
        if path.stat().st_size == 0:
            raise ImportFormatError(f"{path}: empty file (the writer creates it with its first record)")
        for line, record in _records(path):
            where = f"{path}:{line}"
            layout, seq = _take(record, step, rank, where, run, layouts)
            if stats is None:
                stats = Stats(layout, where, version=version)
            if seq is None:
                stats.skipped_sft += 1
                continue
            stats.any_mask |= seq.kept is not None
            run.sequences.append(seq)
    assert stats is not None  # at least one non-empty file was read
    stats.sequences = len(run.sequences)
    stats.files = len(files)
    traces, verifiers_version, n_trace_files = (trace_index(src, steps) if (src / "rollouts").is_dir()
                                                else ({}, None, 0))
    if n_trace_files:
        stats.matched = 0
        stats.verifiers = (str(verifiers_version), str(src / "rollouts"))
        for seq in run.sequences:
            branch = traces.get(tuple(seq.full_ids.tolist()))
            if branch is None:
                continue
            stats.matched += 1
            seq.prompt, seq.response, seq.finish_reason = branch.prompt, branch.response, branch.finish_reason
            seq.reward = branch.reward if branch.reward is not None else seq.reward
            if branch.group is not None:
                seq.prompt_key = ("group", branch.group)
        stats.files += n_trace_files
    run.scalars = step_scalars(src / "metrics.jsonl", steps) if (src / "metrics.jsonl").is_file() else {}
    stats.metrics = bool(run.scalars)
    return _describe(run, stats)
