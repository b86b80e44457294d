"""Import NeMo-RL's per-step GRPO training data (``train_data_step<N>.jsonl`` in the logger's ``log_dir``).

Writer: ``nemo_rl/algorithms/grpo.py`` (``grpo_train`` and ``async_grpo_train``, the "Log training data" block,
unless ``env.should_log_nemo_gym_responses``) through ``Logger.log_batched_dict_as_jsonl`` in
``nemo_rl/utils/logger.py``: one line per sample from ``BatchedDataDict.make_microbatch_iterator(1)``, so every
value keeps a batch dimension of 1 (``"rewards": [r]``, ``"token_ids": [[...]]``), tensors through ``tolist()``,
``json.dumps(..., default=str)`` (NaN written as a bare ``NaN``) plus ``"idx"``. ``N`` is the 1-based step.
Per-token lists are padded on the right to the batch's length (``batched_message_log_to_flat_message``);
``input_lengths`` is the unpadded length. ``token_loss_mask`` is 1 on generated assistant tokens (prompt, tool
and padding 0); ``generation_logprobs`` is the generation engine's log-prob (0 elsewhere); ``prev_logprobs`` is
``policy.get_logprobs`` before the update, aligned so index t scores token t (index 0 is 0). Keys: ``content``,
``rewards``, ``input_lengths``, ``token_ids``, ``token_loss_mask``, ``sample_loss_mask``, ``advantages``,
``generation_logprobs``, ``prev_logprobs``, ``idx``; ``agent_ref`` with NeMo Gym agents (#1989, Feb 2026) and
``filtered_rewards`` with dynamic sampling (#602, Oct 2025; then ``rewards`` is ``total_reward``). These have not
changed since NeMo-RL 0.2 (April 2025); a line with another key set is refused naming the file and line.

Mapping: rows are the ``token_loss_mask`` positions within ``input_lengths``, ``pos`` 0 = the first of them;
``mu_logprob`` = ``generation_logprobs``; ``pi_logprob`` and ``old_logprob`` = ``prev_logprobs``: the only
trainer log-prob in the file, the policy *before* the update (pi_old), so ratio rules replay on pi_old / mu (the
training-inference mismatch). A run with ``force_on_policy_ratio`` writes zeros there instead and is refused.
``advantage`` = ``advantages``; no entropy; ``kept`` = ``sample_loss_mask`` (0 zeroes a whole sample's loss; the
clip mask is not logged). Samples: ``sample_id`` = ``idx``, ``prompt_id`` groups equal prompt token ids,
``response`` = the last message's ``content``, ``prompt`` = the earlier messages joined by newlines, ``reward`` =
``rewards``.
"""

from __future__ import annotations

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
    floats,
    ints,
    json_lines,
    keep_unknown,
    register_importer,
)
from trustscope.importers.base import combine as base_combine

REQUIRED = frozenset({"content", "rewards", "input_lengths", "token_ids", "token_loss_mask", "sample_loss_mask",
                      "advantages", "generation_logprobs", "prev_logprobs", "idx"})
OPTIONAL = frozenset({"agent_ref", "filtered_rewards"})
PER_TOKEN = ("token_ids", "token_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")
_FILE = re.compile(r"^train_data_step(\d+)\.jsonl$")

NOTES = {
    "mu_logprob": "generation_logprobs (the generation engine's)",
    "pi_logprob": "prev_logprobs: the trainer's log-prob before the update (pi_old), the only trainer log-prob "
                  "NeMo-RL writes; pi = pi_old here",
    "old_logprob": "prev_logprobs (pi_old, the same values as pi_logprob)",
    "advantage": "advantages (per token)",
    "entropy": "not written by NeMo-RL (null)",
    "kept": "sample_loss_mask (a whole sample's loss zeroed); the clip mask is not written",
    "rows": "token_loss_mask tokens within input_lengths",
}


def step_files(src: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of ``src`` itself (one file) or of every ``train_data_step<N>.jsonl`` in it, by step."""
    if src.is_file():
        m = _FILE.match(src.name)
        if not m:
            raise ImportFormatError(f"{src}: not named train_data_step<N>.jsonl")
        return [(int(m.group(1)), src)]
    if not src.is_dir():
        raise ImportFormatError(f"{src}: no such file or directory")
    found = sorted((int(m.group(1)), p) for p in src.iterdir() if (m := _FILE.match(p.name)))
    if not found:
        raise ImportFormatError(f"{src}: no train_data_step<N>.jsonl files (NeMo-RL's log_dir)")
    return found


def _one(record: dict, key: str, where: str) -> Any:
    """The single batch entry of ``record[key]`` (the writer keeps a batch dimension of 1)."""
    value = record[key]
    if not isinstance(value, list) or len(value) != 1:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ImportFormatError(f"{where}: {key!r} must be a batch of one (a list of one entry), got {got}")
    return value[0]


def _index(record: dict, where: str) -> int:
    """The line's ``idx`` (its position in the step's batch, added by the writer): the sample id."""
    idx = record["idx"]
    if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
        raise ImportFormatError(f"{where}: idx {idx!r} is not a sample position")
    return idx


def _sequence(record: Any, step: int, where: str, run: ImportedRun) -> Sequence:
    """One line's sequence; its keys NeMo-RL's writer does not write are kept on it where a column takes them
    and noted in ``run`` (:func:`~trustscope.importers.base.keep_unknown`)."""
    if not isinstance(record, dict):
        raise ImportFormatError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    keys = set(record)
    if not keys >= REQUIRED:
        raise ImportFormatError(f"{where}: keys do not match NeMo-RL's train data (missing "
                                f"{sorted(REQUIRED - keys)}, unknown {sorted(keys - REQUIRED - OPTIONAL)})")
    cols = {name: _one(record, name, where) for name in PER_TOKEN}
    width = len(cols["token_ids"]) if isinstance(cols["token_ids"], list) else -1
    for name, value in cols.items():
        if not isinstance(value, list) or len(value) != width:
            got = len(value) if isinstance(value, list) else type(value).__name__
            raise ImportFormatError(f"{where}: {name!r} has length {got}, 'token_ids' has {width}")
    length = _one(record, "input_lengths", where)
    if not isinstance(length, int) or not 0 < length <= width:
        raise ImportFormatError(f"{where}: input_lengths {length!r} outside (0, {width}] (the padded length)")
    token_ids = ints(cols["token_ids"], where, "token_ids")[:length]
    loss_mask = floats(cols["token_loss_mask"], where, "token_loss_mask")[:length]
    if not np.isin(loss_mask, (0.0, 1.0)).all():
        raise ImportFormatError(f"{where}: token_loss_mask must hold 0/1, got {loss_mask[~np.isin(loss_mask, (0, 1))][0]}")
    idx = np.flatnonzero(loss_mask)
    if not idx.size:
        raise ImportFormatError(f"{where}: no token_loss_mask token within input_lengths {length}")
    first, end = int(idx[0]), int(idx[-1]) + 1
    span = slice(first, end)
    reward = _one(record, "rewards", where)
    sample_mask = _one(record, "sample_loss_mask", where)
    if not isinstance(reward, (int, float)) or not isinstance(sample_mask, (int, float)):
        raise ImportFormatError(f"{where}: rewards and sample_loss_mask must be numbers, got {reward!r}, "
                                f"{sample_mask!r}")
    content = _one(record, "content", where)
    messages = [str(c) for c in content] if isinstance(content, list) else [str(content)]
    prev = floats(cols["prev_logprobs"], where, "prev_logprobs")[span]
    seq = Sequence(
        step=step, rank=0, where=where, token_id=token_ids[span], sample_id=_index(record, where),
        mu_logprob=floats(cols["generation_logprobs"], where, "generation_logprobs")[span],
        pi_logprob=prev, old_logprob=prev,
        advantage=floats(cols["advantages"], where, "advantages")[span],
        mask=loss_mask[span] > 0, kept=np.full(end - first, sample_mask != 0),
        prompt_key=tuple(token_ids[:first].tolist()),
        prompt="\n".join(messages[:-1]) if len(messages) > 1 else None,
        response=messages[-1] if messages else None, reward=float(reward),
    )
    for name in sorted(keys - REQUIRED - OPTIONAL):  # a newer or forked writer's keys, each a batch of one
        value = record[name]
        if isinstance(value, list) and len(value) == 1:
            keep_unknown(run, seq, {name: value[0]}, [name], width, span, where)
        else:
            run.unknown.setdefault(name, where)
            if name not in run.extra_types:
                run.skipped.setdefault(name, "not a batch of one, as the writer writes every key")
    return seq


def list_steps(src: Path) -> list[int]:
    """The steps of ``src`` (one file, or the step files of a directory; none is refused as :func:`read` does)."""
    return [step for step, _ in step_files(Path(src))]


def _optional_keys() -> SameThroughout[frozenset[str]]:
    return SameThroughout("files of differently configured or versioned runs are mixed",
                          lambda keys: f"optional keys {sorted(keys)}")


def combine(so_far: ImportedRun, step: ImportedRun) -> ImportedRun:
    """Steps read one by one must have the same optional keys (a run configured one way throughout)."""
    keys = _optional_keys()
    for part in (so_far, step):
        if part.stats is not None:
            keys.check(*part.stats)
    merged = base_combine(so_far, step)
    merged.stats = keys.first
    return merged


def finished_steps(src: Path, settle_s: float, now: float) -> Listing:
    """The steps of a running job's train data and those its writer finished (``--follow``):
    ``Logger.log_batched_dict_as_jsonl`` writes ``train_data_step<N>.jsonl`` in one ``open(..., "w")``, one line
    per sample, and writes no marker: the file is finished once a later step's file exists, or once it ends with
    a closed line and has not changed for ``settle_s``."""
    if src.is_file():
        files = step_files(src)
    elif src.is_dir():
        files = sorted((int(m.group(1)), p) for p in src.iterdir() if (m := _FILE.match(p.name)))
    else:
        raise SourceGone(f"{src}: no such file or directory")
    finished = set()
    for i, (n, path) in enumerate(files):
        if i + 1 < len(files):  # the writer writes the steps in order, each file in one go
            finished.add(n)
            continue
        stat = path.stat()
        if stat.st_size and now - stat.st_mtime >= settle_s:
            with path.open("rb") as f:
                f.seek(-1, 2)
                if f.read(1) == b"\n":
                    finished.add(n)
    return Listing(frozenset(n for n, _ in files), frozenset(finished))


@register_importer("nemo-rl", reads="train_data_step<N>.jsonl (GRPO's per-step training data, in its log_dir)",
                   steps=list_steps, combine=combine, finished=finished_steps)
def read(src: Path, *, version: str | None = None, steps: Collection[int] | None = None) -> ImportedRun:
    """Parse and check every step file (of ``steps`` when given); see the module docstring for the mapping."""
    src = Path(src)
    files = [(step, path) for step, path in step_files(src) if steps is None or step in steps]
    run = ImportedRun(
        framework="nemo-rl", version=version or "unknown (train_data_step<N>.jsonl, unchanged since NeMo-RL 0.2)",
        format="nemo-rl grpo train_data_step<N>.jsonl", src=src, loss_rule="nemo-rl", notes=dict(NOTES),
        files=len(files))
    sequences = run.sequences
    optional_keys = _optional_keys()
    for step, path in files:
        start = len(sequences)
        for line, record in json_lines(path):
            where = f"{path}:{line}"
            seq = _sequence(record, step, where, run)
            optional_keys.check(frozenset(record) & OPTIONAL, where)
            sequences.append(seq)
        if len(sequences) == start:
            raise ImportFormatError(f"{path}: empty file (the writer writes one line per sample)")
        trained = sequences[start:]
        if all(not s.pi_logprob[s.mask].any() for s in trained):
            raise ImportFormatError(f"{path}: prev_logprobs are 0 on every trained token: the run skipped them "
                                    f"(force_on_policy_ratio), so the file holds no trainer log-prob to import")
    run.stats = optional_keys.first
    return run
