"""Run files and status: the run directory, the manifests (``run.json``, ``ranks/rank<r>.json``), the vocab, and the status readers."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trustscope import schema as S
from trustscope.schema import SchemaError


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks (Linux), to tell a live writer from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start is not None and Path("/proc").is_dir():
        return _process_start(pid) == start
    return True


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = S.tmp_path(path)
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def resolve_rank(rank: int | None = None) -> int:
    """The process's rank: ``rank`` if given, else torch.distributed's (when initialised), else ``$RANK``, else 0."""
    if rank is not None:
        return int(rank)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))
_FILE_RE = re.compile(r"^r(\d+)-s(\d+)-(\d+)-")
_RUN_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _rank_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its status: ``run.json`` for rank 0, ``ranks/rank<r>.json`` for the others."""
    return run_dir / S.MANIFEST if rank == 0 else run_dir / S.RANKS_DIR / f"rank{rank:04d}.json"


def _rank_data_files(run_dir: Path, rank: int) -> list[Path]:
    prefix = f"r{rank:04d}-"
    return [p for t in S.TABLES if (run_dir / t).is_dir() for p in (run_dir / t).iterdir()
            if p.name.startswith(prefix) and S.is_data_file(p)]


def _last_step_on_disk(run_dir: Path, rank: int) -> int | None:
    steps = [int(m.group(3)) for p in _rank_data_files(run_dir, rank) if (m := _FILE_RE.match(p.name))]
    return max(steps) if steps else None


def _vocab_texts(vocab: Any) -> list[str]:
    """Token texts indexed by id from a list, a {id: text} dict or a Hugging Face tokenizer."""
    if isinstance(vocab, Mapping):
        size = max(vocab) + 1 if vocab else 0
        texts: list[Any] = [None] * size
        for i, text in vocab.items():
            texts[int(i)] = text
        return texts
    if isinstance(vocab, Sequence) and not isinstance(vocab, str):
        return list(vocab)
    if hasattr(vocab, "decode") and hasattr(vocab, "__len__"):
        return [vocab.decode([i]) for i in range(len(vocab))]
    raise TypeError(f"vocab must be a list of texts, a {{id: text}} dict or a tokenizer, got {type(vocab).__name__}")


def _jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (dataclasses and paths included); checked here so close() cannot fail on it."""
    if obj is None:
        return None
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        obj = asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: manifest is not a JSON object")
    return data


def rank_statuses(run_dir: str | os.PathLike) -> dict[int, str]:
    """Effective status of every rank of a run: a ``running`` rank whose writer process is gone reads ``crashed``.

    A writer on another host cannot be checked from here and keeps ``running``.
    """
    run_dir = Path(run_dir)
    files = [run_dir / S.MANIFEST, *sorted((run_dir / S.RANKS_DIR).glob("rank*.json"))]
    out: dict[int, str] = {}
    host = socket.gethostname()
    for path in files:
        if not path.exists():
            continue
        m = _read_json(path)
        status = m.get("status", "running")
        if status == "running" and m.get("hostname") == host and isinstance(m.get("pid"), int):
            if not _pid_alive(m["pid"], m.get("pid_start")):
                status = "crashed"
        out[int(m.get("rank", 0))] = status
    if not out:
        raise SchemaError(f"{run_dir}: no run manifest")
    return out


def run_status(run_dir: str | os.PathLike) -> str:
    """Effective status of a run: ``crashed`` if any rank crashed, else ``running`` if any runs, else ``finished``."""
    statuses = set(rank_statuses(run_dir).values())
    for status in ("crashed", "running"):
        if status in statuses:
            return status
    return "finished"
