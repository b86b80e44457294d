"""Recovery of a rank a killed writer or compaction left half done: committed flushes rolled forward, staged compactions
swapped in or removed (:func:`recover_rank`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from trustscope.runformat.commits import COMPACTED_KEY, compaction_records, publishing_entries
from trustscope.runformat.errors import CompactionError, describe_error
from trustscope.runformat.fsops import replace_file
from trustscope.runformat.layout import (
    STAGING_DIR,
    SUPERSEDED_DIR,
    TABLES,
    parse_data_file,
    rank_dir_name,
    rank_file,
    table_of,
)
from trustscope.runformat.stores import RunStore, where
from trustscope.runformat.swap import DELETE_AFTER_S, drop_superseded, retire, staging_dir, swap_in


def recover_rank(store: RunStore, run_dir: Any, rank: int, manifest: dict) -> list[str]:
    """Finish or undo what a killed writer or compaction of rank ``rank`` left half done; returns what it did, in
    words. The caller holds the rank (its lock): nothing else writes it meanwhile.

    * A flush the manifest commits whose files were not all renamed into place (``publishing``): renamed now
      (rolled forward); a file whose temporary is gone too (an object store's local spool) is dropped from the
      manifest's ``rows`` and counted as lost.
    * A compaction recorded in the manifest whose staged folders were not all swapped in: swapped now (rolled
      forward). A record none of whose files exists, with nothing staged: dropped (the flush files it would have
      replaced are still read). A staged folder no record names: removed.
    * Superseded folders older than :data:`DELETE_AFTER_S`: removed.
    """
    done: list[str] = []
    changes: dict[str, Any] = {}
    rows = dict(manifest.get("rows") or {})
    lost_rows: dict[str, int] = {}
    for tmp, final, n in publishing_entries(manifest):
        final_path = run_dir / final
        parsed = parse_data_file(final_path.name)
        compacted = parsed is not None and parsed.flush is not None and any(
            r["flushes"][0] <= parsed.flush <= r["flushes"][1] for r in compaction_records(manifest))
        if compacted or store.exists(final_path):
            continue
        if tmp is not None and not store.remote and (run_dir / tmp).exists():
            store.prepare_folder(final_path.parent)
            replace_file(run_dir / tmp, final_path, True)
            done.append(f"renamed {run_dir / tmp} to {final_path} (a committed flush a killed writer had not put "
                        f"in place)")
            continue
        table = table_of(PurePosixPath(final))
        if table in rows and isinstance(n, int):
            rows[table] = max(0, int(rows[table]) - n)
            lost_rows[table] = lost_rows.get(table, 0) + n
        done.append(f"{where(store, final_path)}: a committed file that never landed; its {n} row(s) are "
                    f"counted as lost")
    if lost_rows:
        lost = dict(manifest.get("lost") or {"rows": dict.fromkeys(TABLES, 0), "first_step": None,
                                             "last_step": None, "errors": []})
        lost["rows"] = {t: int((lost.get("rows") or {}).get(t, 0)) + lost_rows.get(t, 0) for t in TABLES}
        lost["errors"] = [*(lost.get("errors") or []), "the writer was killed before its last flush landed"][:10]
        changes.update(rows=rows, lost=lost)
    if done:  # every committed file is in place now, or counted as lost
        changes["publishing"] = []
    records = [dict(r) for r in compaction_records(manifest)]
    whole = [r for r in records if all(store.exists(run_dir / rel) for rel in r["files"])]
    nested = [r for r in records if any(o is not r and o["flushes"][0] <= r["flushes"][0]
                                        and r["flushes"][1] <= o["flushes"][1] for o in whole)]
    for record in nested:  # replaced by a compaction killed before it wrote its manifest the last time
        done.append(f"dropped the record of flushes {record['flushes']}: a larger compaction replaced it")
    if nested:
        records = [r for r in records if not any(r is n for n in nested)]
        changes[COMPACTED_KEY] = records
    if not store.remote:
        run_dir = Path(run_dir)
        staged = {p.name: p for p in (run_dir / STAGING_DIR).glob(f"{rank_dir_name(rank)}-c*")}
        kept = []
        for record in records:
            staging = staging_dir(run_dir, rank, tuple(record["flushes"]))
            if staging.name in staged:
                del staged[staging.name]
                try:
                    tables = swap_in(run_dir, rank, record, staging)
                except (OSError, CompactionError) as err:
                    done.append(f"cannot finish the compaction of flushes {record['flushes']}: {describe_error(err)}")
                    kept.append(record)
                    continue
                retire(run_dir, staging)
                if tables:
                    done.append(f"swapped in the compacted files of flushes {record['flushes']} in "
                                f"{', '.join(tables)} (a compaction killed before its swap)")
            elif not any((run_dir / rel).exists() for rel in record["files"]):
                done.append(f"dropped the record of flushes {record['flushes']}: none of its files exists, "
                            f"the flush files it would replace are read")
                continue
            kept.append(record)
        for table in TABLES:  # a publish of several files killed before its swap (its temporaries are kept)
            staged[f"{table}-{rank_dir_name(rank)}-publish"] = run_dir / STAGING_DIR / \
                f"{table}-{rank_dir_name(rank)}-publish"
        for path in staged.values():
            if not path.exists():
                continue
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path} (staged by a compaction killed before its commit)")
        with contextlib.suppress(OSError):
            (run_dir / STAGING_DIR).rmdir()
        if len(kept) != len(records) or nested:
            changes[COMPACTED_KEY] = kept
        gone = drop_superseded(run_dir, rank, DELETE_AFTER_S)
        if gone:
            done.append(f"removed {gone} superseded file(s) of rank {rank} under {run_dir / SUPERSEDED_DIR}")
    if changes:

        manifest.update(changes)
        store.write_atomic(rank_file(run_dir, rank), json.dumps(manifest, indent=2, default=str))
    return done
