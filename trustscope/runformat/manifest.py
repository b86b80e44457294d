"""Manifests as JSON: reading, writing atomically, the timestamps they carry, and every rank's manifest of a local run.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from trustscope.runformat.errors import SchemaError
from trustscope.runformat.layout import MANIFEST, RANKS_DIR, rank_manifest_paths, tmp_path
from trustscope.runformat.stores import RunStore


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` to a temporary name and rename it over ``path``; on failure no temporary file is left."""
    tmp = tmp_path(path)
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the directory may be read-only by now
            tmp.unlink(missing_ok=True)
        raise


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (dataclasses and paths included); checked here so close() cannot fail on it."""
    if obj is None:
        return None
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        obj = asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def read_json(path: Path, store: RunStore | None = None) -> dict:
    """The manifest at ``path`` (through ``store``, else from local disk); raises SchemaError naming it."""
    try:
        data = json.loads(store.read_bytes(path) if store is not None else path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: manifest is not a JSON object")
    return data


def store_manifests(store: RunStore, run: Path | PurePosixPath) -> dict[int, dict]:
    """Every rank's manifest of the run at ``run``, read through ``store``."""
    paths = [run / MANIFEST, *(run / RANKS_DIR / n for n in sorted(store.names(run / RANKS_DIR))
                                 if n.startswith("rank") and n.endswith(".json"))]
    out = {}
    for path in paths:
        if store.exists(path):
            m = read_json(path, store)
            out[int(m.get("rank", 0))] = m
    if not out:
        raise SchemaError(f"{run}: no run manifest")
    return out


def rank_manifests(run_dir: Path) -> dict[int, dict]:
    out = {}
    for path in rank_manifest_paths(run_dir):
        if path.exists():
            m = read_json(path)
            out[int(m.get("rank", 0))] = m
    if not out:
        raise SchemaError(f"{run_dir}: no run manifest")
    return out
