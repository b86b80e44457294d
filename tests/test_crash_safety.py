"""SIGKILL a logging process at random moments, many times: what is left is always readable and honest."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from trustscope import schema as S
from trustscope.logger import rank_statuses, run_status

WRITER = Path(__file__).with_name("crash_writer.py")
ROWS_PER_STEP = 8 * 16  # B * T in crash_writer.py
KILLS = 10


def steps_on_disk(run_dir: Path) -> dict[int, int]:
    files = sorted((run_dir / "tokens").glob("*.parquet"))
    if not files:
        return {}
    table = ds.dataset(files, format="parquet").to_table(columns=["step"])
    counts = table.group_by("step").aggregate([([], "count_all")])
    return dict(zip(counts["step"].to_pylist(), counts["count_all"].to_pylist(), strict=True))


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_readable_honest_logs(tmp_path):
    rng = random.Random(0)
    run_dir = tmp_path / "crashy"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    reported: set[int] = set()
    seen: dict[Path, int] = {}  # file -> size, checked already
    for kill in range(KILLS):
        on_disk = steps_on_disk(run_dir)
        first = max(on_disk, default=-1) + 1
        proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path), "crashy", str(first)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
        if kill % 3:  # two kills in three come after some progress, at a random moment; one right after start
            line = proc.stdout.readline()
            assert line.startswith("flushed"), line
            reported.add(int(line.split()[1]))
            time.sleep(rng.uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        flushed = [line.split() for line in out.splitlines() if line.startswith("flushed")]
        assert all(torch_loaded == "0" for _, _, torch_loaded in flushed), "the writer should not need torch"
        reported |= {int(step) for _, step, _ in flushed}

        # every visible file is whole Parquet of the right schema; temporary files are hidden from the glob
        visible = sorted(run_dir.rglob("*.parquet"))
        assert all(S.is_data_file(p) for p in visible)
        assert all(p.stat().st_size == size for p, size in seen.items()), "a finished file changed"
        for path in visible:
            if path not in seen:
                assert S.validate_file(path, path.parent.name if path.parent != run_dir else "vocab", "crashy") == []
                seen[path] = path.stat().st_size
        # at most the unflushed steps are missing, and no step is partial
        on_disk = steps_on_disk(run_dir)
        assert reported <= set(on_disk), f"flushed steps lost after kill {kill}"
        assert set(on_disk.values()) <= {ROWS_PER_STEP}
        assert sorted(on_disk) == list(range(len(on_disk))), "steps on disk form a prefix"
        # the manifest says the run did not finish cleanly
        assert run_status(run_dir) == "crashed"
        assert rank_statuses(run_dir) == {0: "crashed"}
    assert len(reported) >= 3, "the writer was killed too early to test anything"
    assert S.validate_logdir(tmp_path) == []
    manifest = S.read_manifest(run_dir)
    assert manifest["status"] == "running"  # as left by the dead writer; run_status reads it as crashed
    assert len(manifest["resumes"]) >= 1
