"""An import written into the log: a source's parts (its steps read on worker processes, or the whole source)
logged through :class:`~trustscope.logger.TokenLogger`'s public API, each part checked before any of its rows is
logged, into a hidden temporary directory inside the log directory, renamed into place when finished (a failure
removes it: the log directory never holds a partial import); the per-step logger calls, the routing shape of a
source that keeps the engine's experts, and the run's description in ``run.json``."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import secrets
import shutil
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trustscope.columns import turns_from_mask
from trustscope.importers.base import (
    IMPORTERS,
    NUMPY_TYPES,
    ImportedRun,
    ImportFormatError,
    Sequence,
    check_values,
    combine,
    name_unknown,
    scored,
)


def _extra_parts(seqs: list[Sequence], name: str, kind: str, masks: list[np.ndarray]) -> list[np.ndarray] | None:
    """Column ``name`` (declared ``kind``) of each sequence as a ``(T,)`` array, a scalar broadcast and a
    missing value null; None when a scored token would hold a null number (no numeric column takes one: the
    column is left out of the call, so its rows read NULL)."""
    dtype = NUMPY_TYPES[kind]
    parts = []
    for seq, keep in zip(seqs, masks, strict=True):
        value = seq.extra.get(name)
        n = len(seq.token_id)
        if isinstance(value, np.ndarray):
            if kind == "int64" and value.dtype.kind == "f":
                if not np.isfinite(value[keep]).all():
                    return None
                value = np.where(keep, value, 0.0)
                if (value != np.round(value)).any():
                    raise ImportFormatError(f"{seq.where}: field {name!r} holds fractions, earlier records "
                                            f"integers only")
            part = value.astype(dtype, copy=False)
        else:
            if value is None and kind != "string":
                if keep.any():
                    return None
                value = 0
            part = np.full(n, value, dtype=dtype)
        if part.dtype.kind == "f" and not np.isfinite(part[keep]).all():
            return None
        parts.append(part)
    return parts


def _step_call(seqs: list[Sequence], sample_ids: list[int], prompt_ids: list[int],
               extra_types: Mapping[str, str], routing: bool = False) -> tuple[dict, list, dict, list[str]]:
    """The ragged ``tokens``, ``mask`` and ``samples`` arguments of one ``log_step`` call (each per-token column
    a list of the sequences' own arrays: nothing padded), and the extra columns left out of it (nulls).
    ``routing``: the call carries the sequences' ``engine_experts``."""
    masks = [scored(s) for s in seqs]
    tokens: dict[str, Any] = {
        "token_id": [s.token_id for s in seqs],
        "mu_logprob": [s.mu_logprob for s in seqs],
        "pi_logprob": [s.pi_logprob for s in seqs],
        "advantage": [s.advantage for s in seqs],
        "turn": [turns_from_mask(s.mask) for s in seqs],  # a new model turn after each gap in the trained positions
        "sample_id": np.array(sample_ids, dtype=np.int64),
        "prompt_id": np.array(prompt_ids, dtype=np.int64),
    }
    for name in ("old_logprob", "entropy"):
        if all(getattr(s, name) is not None for s in seqs):
            tokens[name] = [getattr(s, name) for s in seqs]
    if any(s.kept is not None for s in seqs):
        tokens["kept"] = [s.kept if s.kept is not None else np.ones(len(s.token_id), dtype=bool) for s in seqs]
    for name in ("policy_version", "policy_version_last"):  # per sequence, when every sequence has one
        if all(getattr(s, name) is not None for s in seqs):
            tokens[name] = np.array([getattr(s, name) for s in seqs], dtype=np.int64)
    nulled = []
    if routing:
        tokens["engine_experts"] = [s.engine_experts for s in seqs]
    for name, kind in extra_types.items():
        parts = _extra_parts(seqs, name, kind, masks)
        if parts is None:
            nulled.append(name)
        else:
            tokens[name] = parts
    samples: dict[str, Any] = {
        "sample_id": sample_ids,
        "prompt_id": prompt_ids,
        "prompt": [s.prompt for s in seqs],
        "response": [s.response for s in seqs],
        "finish_reason": [s.finish_reason for s in seqs],
    }
    rewards = [s.reward for s in seqs]
    if all(r is not None and np.isfinite(r) for r in rewards):  # the samples table takes all or none per call
        samples["reward"] = rewards
    return tokens, masks, samples, nulled


def _ids(seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """Sample ids (the source's own when every sequence of the step has a unique one, else their order) and
    prompt ids (one per distinct ``prompt_key``, in order of first appearance) of one step's sequences."""
    own = [s.sample_id for s in seqs]
    if None in own or len(set(own)) != len(own):
        own = list(range(len(seqs)))
    prompts: dict[Any, int] = {}
    prompt_ids = [prompts.setdefault(s.prompt_key if s.prompt_key is not None else ("sample", i), len(prompts))
                  for i, s in enumerate(seqs)]
    return own, prompt_ids


def log_step(loggers: Mapping[int, Any], step: int, seqs: list[Sequence], scalars: Mapping[str, float] | None,
             ranks: Collection[int] | None = None, extra_types: Mapping[str, str] | None = None,
             loss_rule: str | None = None, routing: bool = False) -> list[str]:
    """Log one step's sequences (each source rank through its own logger of ``loggers``) and scalars (rank 0's
    logger), one ``log_step`` call per rank, so no flush ever holds part of a rank's share of the step.
    ``ranks``: only these ranks' share (a followed run, whose ranks commit one after the other); None, all.
    ``extra_types``: the run's own columns (the loggers' ``extra_columns``) filled from ``Sequence.extra``.
    ``routing``: the loggers declare ``routing_shape``; the step's ``engine_experts`` are logged when every
    sequence has them on every scored token, else left out (NULL) and named among the columns left out.
    Returns the extra columns some call left out (a null number on a scored token)."""
    seqs = sorted(seqs, key=lambda s: s.rank)
    sample_ids, prompt_ids = _ids(seqs)  # over the whole step, whichever ranks are logged
    present = {s.rank for s in seqs}
    nulled: list[str] = []
    if routing and not all(s.engine_experts is not None and (s.engine_experts[scored(s)] >= 0).all()
                           for s in seqs):
        routing = False
        nulled.append("engine_experts")
    for rank in sorted(present | ({0} if scalars else set())):
        if ranks is not None and rank not in ranks:
            continue
        kwargs: dict[str, Any] = {"scalars": scalars} if rank == 0 and scalars else {}
        if rank in present:
            idx = [i for i, s in enumerate(seqs) if s.rank == rank]
            kwargs["tokens"], kwargs["mask"], kwargs["samples"], left = _step_call(
                [seqs[i] for i in idx], [sample_ids[i] for i in idx], [prompt_ids[i] for i in idx],
                extra_types or {}, routing)
            nulled += [name for name in left if name not in nulled]
        loggers[rank].log_step(step, loss_rule=loss_rule, **kwargs)
    return nulled


def unscored(seqs: list[Sequence]) -> int:
    """Trained tokens left out as unscored (a NaN log-prob, advantage or entropy)."""
    return int(sum(int((s.mask & ~scored(s)).sum()) for s in seqs))


def _read_step(fmt: str, src: Path, version: str | None, step: int, options: Mapping[str, Any]) -> ImportedRun:
    """One step of ``src``, on a worker process (its own warnings are the combined run's, named once there)."""
    import trustscope.importers  # noqa: F401  (a spawned worker registers the formats here)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)
        run = IMPORTERS[fmt].read(src, version=version, steps={step}, **options)
    for seq in run.sequences:  # joined to the other streams already: not sent back
        seq.full_ids = None
    return run


def default_workers() -> int:
    """Worker processes that parse steps while the importing process writes: the cores this process may use that
    other work leaves idle (the cores minus the 1-minute load average), at most 4; 1 (read in the importing
    process) when none is. On busy cores a worker only adds its start and each step's transfer (measured in
    ``docs/performance.md``, "Importers")."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available here
        load = 0.0
    return max(1, min(4, int(cores - load)))


def read_steps(fmt: str, src: Path, *, version: str | None = None, workers: int | None = None,
               options: Mapping[str, Any] | None = None) -> Iterator[ImportedRun]:
    """Each step of ``src`` (format ``fmt``, which lists its steps: :attr:`ImportFormat.steps`) read alone, in
    order. ``workers`` > 1 (default :func:`default_workers`): read on that many worker processes, at most
    ``workers + 1`` steps ahead of the one handed out, so memory holds a few steps whatever the source's size."""
    importer = IMPORTERS[fmt]
    assert importer.steps is not None
    options = dict(options or {})
    steps = importer.steps(src, **options)
    workers = default_workers() if workers is None else workers
    if workers <= 1 or len(steps) <= 1:
        for step in steps:
            yield _read_step(fmt, src, version, step, options)
        return
    # fork is cheap and safe while this process has no other thread (the usual case: the loggers start once the
    # first step is back, after every worker exists); with threads running, workers start from a clean server
    method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(min(workers, len(steps)), mp_context=mp.get_context(method)) as pool:
        ahead: collections.deque = collections.deque()
        todo = iter(steps)
        try:
            for step in itertools.islice(todo, workers + 1):
                ahead.append(pool.submit(_read_step, fmt, src, version, step, options))
            while ahead:
                part = ahead.popleft().result()
                for step in itertools.islice(todo, 1):
                    ahead.append(pool.submit(_read_step, fmt, src, version, step, options))
                yield part
        finally:
            for future in ahead:
                future.cancel()


ANY_EXPERT = int(np.iinfo(np.int16).max)
"""The expert count a run is declared with when neither the source nor the tokenizer's directory names it (the
dumps keep expert ids, not the count): ids are then checked against the int16 column's range only."""


def routing_shape(run: ImportedRun, vocab: Any = None) -> tuple[int, int, int] | None:
    """The ``routing_shape`` ``(MoE layers, top-k, experts)`` of a source that holds routed experts (None when it
    holds none): layers and top-k from its arrays; the expert count from the model config beside the tokenizer
    (``--tokenizer``, a model directory), else :data:`ANY_EXPERT`. ImportFormatError when that config's layers or
    top-k differ from the arrays', naming both shapes."""
    if run.routing is None:
        return None
    from trustscope.routing import moe_shape

    layers, top_k = run.routing
    where = getattr(vocab, "name_or_path", None)
    try:
        model = json.loads((Path(where) / "config.json").read_text(), object_hook=_attrs) if where else None
    except (OSError, ValueError):  # no model config beside the tokenizer
        model = None
    if not isinstance(model, _attrs) or model.num_hidden_layers is None:
        return layers, top_k, ANY_EXPERT
    config = moe_shape(model)
    if config is None:
        raise ImportFormatError(f"{run.src}: routed experts of shape (tokens, {layers}, {top_k}), but the model "
                                f"config in {where} is a dense model (it names no experts)")
    if config[:2] != (layers, top_k):
        raise ImportFormatError(f"{run.src}: routed experts of shape (tokens, {layers}, {top_k}), but the model "
                                f"config in {where} routes (tokens, {config[0]}, {config[1]}) (MoE layers, top-k)")
    return config


class _attrs(dict):
    """A JSON object read as attributes (``config.num_experts``), missing ones None, for :func:`moe_shape`."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


def check_experts(seq: Sequence, shape: tuple[int, int, int]) -> None:
    """Routed experts on scored positions against the run's ``routing_shape``: an id outside ``[0, experts)``
    (-1, the writers' filler, excepted) is refused naming the sequence, the position and the value."""
    arr = seq.engine_experts
    if arr is None:
        return
    bad = seq.mask[:, None, None] & ((arr < -1) | (arr >= shape[2]))
    if bad.any():
        pos, layer, slot = (int(x) for x in np.argwhere(bad)[0])
        raise ImportFormatError(f"{seq.where}: engine_experts {int(arr[pos, layer, slot])} at response position "
                                f"{pos}, MoE layer {layer}, slot {slot}: expert ids are in [0, {shape[2]})")


def check_routing(run: ImportedRun, shape: tuple[int, int, int], where: Any) -> None:
    """A part's routed experts against the run's ``routing_shape``: the same (MoE layers, top-k) as the steps
    before (ImportFormatError naming ``where`` and both shapes: a run does not mix models), and every id in range
    (:func:`check_experts`)."""
    if run.routing not in (None, shape[:2]):
        raise ImportFormatError(f"{where}: routed experts of (MoE layers, top-k) {run.routing}, the run's "
                                f"{shape[:2]}: a run does not mix models")
    for seq in run.sequences:
        check_experts(seq, shape)


def write_run(run: ImportedRun, logdir: str | Path, run_id: str | None = None, vocab: Any = None,
              token_fraction: float = 1.0) -> Path:
    """Write ``run`` (a whole source, read) as ``<logdir>/<run_id>``: :func:`write_steps` of it alone."""
    return write_steps(iter([run]), logdir, run_id, vocab=vocab, token_fraction=token_fraction)


def write_steps(parts: Iterator[ImportedRun], logdir: str | Path, run_id: str | None = None, vocab: Any = None,
                token_fraction: float = 1.0, combine: Callable[[ImportedRun, ImportedRun], ImportedRun] = combine
                ) -> Path:
    """Write the parts of one source (its steps, each read alone, in order; or the whole source as one part) as
    ``<logdir>/<run_id>`` through :class:`TokenLogger`; returns the run directory.

    ``vocab`` (a tokenizer or a list of token texts, as ``TokenLogger`` takes it) writes the run's vocab table, so
    statistics name tokens. Each source rank is written by its own logger (rank 0 always exists: it writes
    ``run.json``); each part's values are checked before any of its rows is logged. The run is built in
    ``<logdir>/.import-<run_id>-<random>/`` and renamed into place when every logger has closed; on any error
    (a part that does not parse, a value no writer produces) the temporary directory is removed and the error
    re-raised, so nothing is written. ``run.json`` then records what the whole source held
    (``combine`` over the parts: format, notes, files, sequences, unscored tokens). The fields trustscope does not
    know are kept as the run's own columns (``extra_columns``, the types the first part shows) or left out, and
    named once (:func:`name_unknown`).

    ``token_fraction`` < 1 writes the token rows of that share of sequences (the logger's hash of step and sample
    id) and the exact ``summaries`` table over every token, as a trainer's logger does.
    """
    from trustscope.logger import TokenLogger  # the parse above needs none of the writer's libraries
    from trustscope.runformat.fsops import fsync_file

    vocab_size = None if vocab is None else len(vocab)
    first = next(parts, None)
    if first is None:
        raise ImportFormatError("the source holds no step")
    for seq in first.sequences:
        check_values(seq, vocab_size)
    logdir = Path(logdir)
    run_id = run_id or f"{first.framework}-{first.src.resolve().name}"
    target = logdir / run_id
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose another --run-id or remove it")
    logdir.mkdir(parents=True, exist_ok=True)
    tmp_root = logdir / f".import-{run_id}-{secrets.token_hex(4)}"
    header = dataclasses.replace(first, sequences=[], scalars={})  # the run's description, without its rows
    declared = dict(first.extra_types)
    routed = routing_shape(first, vocab)  # the first part's routed experts declare the run's routing_shape
    loggers: dict[int, TokenLogger] = {}
    sequences = unscored_tokens = 0
    nulled: list[str] = []

    def described(run: ImportedRun) -> tuple[dict, dict]:
        config = {"import": {"format": run.format, "src": str(run.src), "files": run.files,
                             "sequences": sequences, "unscored_tokens": unscored_tokens, "columns": run.notes}}
        return config, {"framework": run.framework, "version": run.version, "format": run.format,
                        "src": str(run.src)}

    def logger(rank: int) -> TokenLogger:
        if rank not in loggers:
            config, source = described(header)
            # with every token written the token rows are exact without the summaries table, whose rule masks
            # need torch; a token_fraction sample gets the exact summaries over every token, as the logger has
            loggers[rank] = TokenLogger(tmp_root, run_id, config=config, loss_rule=header.loss_rule, vocab=vocab,
                                        mu_source="imported", source=source, rank=rank, flush_seconds=3600.0,
                                        summaries=token_fraction < 1.0, token_fraction=token_fraction,
                                        extra_columns=declared, routing_shape=routed,
                                        fsync=False)  # synced once, before the rename
        return loggers[rank]

    try:
        logger(0)  # rank 0 first: it writes run.json
        part: ImportedRun | None = first
        del first  # each part's rows go once they are logged
        checked = True  # the first part's values are, above
        while part is not None:
            if not checked:
                for seq in part.sequences:
                    check_values(seq, vocab_size)
                header = combine(header, part)
            checked = False
            if routed is not None:
                check_routing(part, routed, part.src)
            by_step: dict[int, list[Sequence]] = {}
            for seq in part.sequences:
                by_step.setdefault(seq.step, []).append(seq)
            for rank in sorted({s.rank for s in part.sequences}):
                logger(rank)
            for step in sorted(set(by_step) | set(part.scalars)):
                left = log_step(loggers, step, by_step.get(step, []), part.scalars.get(step),
                                extra_types=declared, loss_rule=part.loss_rule, routing=routed is not None)
                nulled += [name for name in left if name not in nulled]
            sequences += len(part.sequences)
            unscored_tokens += unscored(part.sequences)
            part = next(parts, None)
        for rank in sorted(loggers, reverse=True):  # rank 0 last
            loggers.pop(rank).close()
        config, source = described(header)
        if nulled:
            config["import"]["columns"]["nulls"] = (f"left out (NULL) of the steps where a scored token held a null: "
                                                    f"{', '.join(nulled)}")
        _describe(tmp_root / run_id, config, source, header.loss_rule)
        sync_tree(tmp_root / run_id)
        (tmp_root / run_id).rename(target)
        fsync_file(logdir)  # the rename
    except BaseException:
        for open_logger in loggers.values():
            with contextlib.suppress(Exception):  # the import's own error is the one to report
                open_logger.close(status="crashed", error="import failed")
        raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
        with contextlib.suppress(Exception):  # the workers' steps still in flight are dropped
            parts.close()  # type: ignore[attr-defined]
    name_unknown(header, declared)
    return target


def sync_tree(root: Path) -> None:
    """Put every file under ``root`` and every directory's entries on disk. An import's loggers write without
    syncing each file (nothing is visible until the finished run is renamed into place, so a killed import leaves
    no partial run whatever was synced); the run is synced once, before that rename, so the renamed run is as
    durable as one whose every file was synced as it was written."""
    from trustscope.runformat.fsops import fsync_file

    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_file(Path(folder, name))
        fsync_file(folder)


def _describe(run_dir: Path, config: dict, source: dict, loss_rule: str) -> None:
    """Put what the whole source held into ``run.json`` of a finished import (the loggers opened with what the
    first step showed); the run is not in place yet, so no reader sees the first version."""
    from trustscope.runformat.layout import MANIFEST

    path = run_dir / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(config=config, source=source, loss_rule=loss_rule)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, path)
