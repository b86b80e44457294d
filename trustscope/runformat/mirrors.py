"""Readers of object store logs: :func:`mirror` copies a prefix's committed objects (and the manifests that commit them)
into a local folder, downloading an object again only when its ETag changed; :func:`stray_objects` names what no
manifest commits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from trustscope.runformat.layout import SCHEME, TABLES, tmp_path
from trustscope.runformat.retry import StorageError
from trustscope.runformat.stores import (
    LocalStore,
    ObjectStore,
    committed_objects,
    parse_url,
    remote_runs,
    run_objects,
)

INDEX = ".trustscope-mirror.json"
"""The mirror's record of what it holds: relative path -> the ETag of the object it was copied from."""


MANIFEST_TAG = "manifest"
"""The index's mark for a manifest: manifests are copied at every update (they change at every commit)."""


def default_mirror_root() -> Path:
    """Where mirrors of object store prefixes are kept: ``s3/`` under :func:`trustscope.paths.cache_root`."""
    from trustscope.paths import cache_root

    return cache_root() / "s3"


def mirror_dir(url: str, root: Path) -> Path:
    """The local folder that mirrors ``url``: ``<root>/<hash of the URL>/<last part of the URL>``, so a run's
    folder keeps its run id as its name."""
    bucket, prefix = parse_url(url)
    canonical = f"{SCHEME}{bucket}" + (f"/{prefix}" if prefix else "")
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return Path(root) / digest / (prefix.rsplit("/", 1)[-1] if prefix else bucket)


def stray_objects(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The URLs of the ``.parquet`` objects under the table prefixes of each run under ``url`` that no manifest
    commits: what a plain reader of the prefix reads and trustscope does not (``trustscope validate`` names them;
    ``trustscope compact`` removes those provably superseded or orphaned). Raises :class:`StorageError`."""
    store = ObjectStore(url, storage_options, write=False)
    try:
        fs, out = store.fsspec, []
        for run in remote_runs(fs, str(store.logdir)):
            _, committed = committed_objects(fs, run)
            out += [f"{SCHEME}{run}/{rel}" for rel in sorted(run_objects(fs, run))
                    if rel.split("/")[0] in TABLES and rel.endswith(".parquet") and rel not in committed]
        return out
    except StorageError:
        raise
    except Exception as err:
        raise StorageError(f"{store.url}: cannot list the object store: {type(err).__name__}: {err}") from None
    finally:
        store.close()


def mirror(url: str, root: Path | None = None, storage_options: Mapping[str, Any] | None = None,
           store: ObjectStore | None = None) -> Path:
    """Bring the local mirror of ``url`` up to date and return its folder (see :func:`mirror_dir`).

    For each run: read every rank's manifest, list the run's objects (one paginated listing), download the
    objects whose flush those manifests commit (again only when the ETag changed), write the manifests, and only
    then remove local files whose object is gone or no longer visible; so the mirror too never shows a flush
    without its commit or a commit without its files. Raises :class:`StorageError` naming the URL when the store
    cannot be read.
    """
    store = store or ObjectStore(url, storage_options, write=False)
    local_top = mirror_dir(store.url, root or default_mirror_root())
    index_path = local_top / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    fs, top = store.fsspec, str(store.logdir)
    wanted: dict[str, str] = {}  # path inside the mirror -> ETag
    manifests: dict[str, bytes] = {}
    try:
        for run in remote_runs(fs, top):
            inside = run[len(top):].strip("/")
            run_manifests, run_objects = committed_objects(fs, run)
            manifests.update({str(PurePosixPath(inside, rel)): data for rel, data in run_manifests.items()})
            for rel, entry in run_objects.items():
                local_rel, etag = str(PurePosixPath(inside, rel)), entry.get("ETag", "")
                wanted[local_rel] = etag
                local = local_top / local_rel
                if etag and index.get(local_rel) == etag and local.is_file():
                    continue
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = tmp_path(local)
                fs.get_file(entry["name"], str(tmp))
                os.replace(tmp, local)
                index[local_rel] = etag
    except StorageError:
        raise
    except Exception as err:
        raise StorageError(f"{store.url}: cannot read the object store: {type(err).__name__}: {err}") from None
    disk = LocalStore(local_top)
    for rel, data in manifests.items():
        (local_top / rel).parent.mkdir(parents=True, exist_ok=True)
        disk.write_atomic(local_top / rel, data)
        index[rel] = MANIFEST_TAG
    for rel in set(index) - set(wanted) - set(manifests):  # gone from the store, or no longer visible
        (local_top / rel).unlink(missing_ok=True)
        del index[rel]
    local_top.mkdir(parents=True, exist_ok=True)
    disk.write_atomic(index_path, json.dumps(index))
    return local_top
