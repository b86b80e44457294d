"""``trustscope import --follow``: a running job's dump followed while its writer writes it.

The writers are the importers' own test writers (``PrimeRLExporter`` of ``test_importers_prime_rl``, which writes
as prime-rl's ``TokenExporter`` does, and ``write_step`` of ``test_importers_nemo_rl``, NeMo-RL's
``log_batched_dict_as_jsonl``), run step by step in a thread while the follower polls. Every check compares the
followed run with a one-shot import of the same finished source, row by row per step and rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_importers_nemo_rl import make_batch, write_step
from test_importers_prime_rl import PrimeRLExporter, make_rollouts, pack, write_traces
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.db import connect
from trustscope.importers import ImportFormatError, ImportUsageError, follow_run, import_run
from trustscope.importers.follow import SourceGone
from trustscope.runformat.validation import validate_logdir

FAST = {"poll_s": 0.05, "settle_s": 0.0}
WAIT_S = 60.0  # the longest a writer waits for the follower (a loaded machine); never reached when it works


def counts(logdir: Path) -> tuple[dict[tuple[int, int], int], int, dict[int, int]]:
    """Of the one run under ``logdir``, through the query layer: token rows per ``(step, rank)``; rows sharing
    ``(step, rank, sample_id, pos)`` with another (a step imported twice); rows of the per-step scalar the
    follower writes, per step."""
    with connect(logdir) as db:
        cur = db.cursor()
        rows = {(s, r): n for s, r, n in cur.execute(
            "SELECT step, rank, count(*) FROM tokens GROUP BY step, rank").fetchall()}
        dup = cur.execute("SELECT count(*) - count(DISTINCT (step, rank, sample_id, pos)) FROM tokens"
                          ).fetchone()[0]
        scalars = dict(cur.execute("SELECT step, count(*) FROM steps WHERE name = 'import/unscored_tokens' "
                                   "GROUP BY step").fetchall())
    return rows, dup, scalars


def rows_per_step(logdir: Path) -> dict[tuple[int, int], int]:
    return counts(logdir)[0]


def one_shot(fmt: str, src: Path, tmp: Path) -> dict[tuple[int, int], int]:
    import_run(fmt, src, tmp / "one-shot", run_id="one")
    return rows_per_step(tmp / "one-shot")


class Following:
    """The follower in a thread: each committed step is recorded with what the writer had done by then."""

    def __init__(self, fmt: str, src: Path, logdir: Path, writer_progress=lambda: None, **kwargs):
        self.steps: list[int] = []
        self.writer_at: list = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.result = None

        def on_step(step, sequences, rows):
            self.steps.append(step)
            self.writer_at.append(writer_progress())

        def run():
            try:
                self.result = follow_run(fmt, src, logdir, run_id="live", on_step=on_step,
                                         should_stop=self.stop.is_set, **kwargs)
            except BaseException as err:  # handed to the test
                self.error = err

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait_for(self, step: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while step not in self.steps:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"step {step} never imported (imported: {self.steps})"
            time.sleep(0.02)

    def join(self) -> None:
        self.stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive()


# ------------------------------------------------------------------------------------------------ prime-rl


class PrimeRLJob:
    """A prime-rl trainer writing its token export step by step: every rank's files, then ``STABLE``."""

    def __init__(self, out: Path, ranks: int = 2, seed: int = 0):
        self.out, self.rng = out, np.random.default_rng(seed)
        self.exporters = [PrimeRLExporter(out, r) for r in range(ranks)]
        self.stable = -1  # the last step marked STABLE

    def write(self, step: int, rank: int) -> None:
        rollouts = make_rollouts(self.rng, 6)
        for micro, part in enumerate((rollouts[:3], rollouts[3:])):
            self.exporters[rank].export(step, micro, *pack(part, pad_to=sum(len(r.prompt) + len(r.completion)
                                                                            for r in part) + 5))
        write_traces(self.out, step, rollouts, f"s{step}r{rank}")

    def finish(self, step: int) -> None:
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "time": 1.7e9, "loss": 0.1 * step}) + "\n")
        self.stable = step
        for exp in self.exporters:
            exp.mark_stable(step)


def test_fields_trustscope_does_not_know_are_columns_of_a_followed_run_and_of_its_restart(tmp_path):
    src = tmp_path / "outputs/run"
    job = PrimeRLJob(src)

    def write_step(step: int) -> None:
        for rank in (0, 1):
            job.write(step, rank)
        for path in (src / f"token_exports/step_{step}").glob("rank_*.jsonl"):
            path.write_text("".join(json.dumps({**r, "teacher_logprobs": r["trainer_logprobs"]}) + "\n"
                                    for r in map(json.loads, path.read_text().splitlines())))
        job.finish(step)

    write_step(0)
    with pytest.warns(ImportWarning, match=r"kept as the run's own columns: teacher_logprobs \(float64\)"):
        follow_run("prime-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0, **FAST)
    write_step(1)
    result = follow_run("prime-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0, **FAST)
    assert result.imported == [1] and validate_logdir(tmp_path / "logs") == []
    manifest = json.loads((tmp_path / "logs/live/run.json").read_text())
    assert manifest["logging"]["extra_columns"] == {"teacher_logprobs": "float64"}
    with connect(tmp_path / "logs") as db:
        got = db.sql("select step, count(*) filter (where abs(teacher_logprobs - pi_logprob) < 1e-6), count(*) "
                     "from tokens group by step order by step").table.to_pylist()
    got = [tuple(row.values()) for row in got]
    assert [(step, same == n > 0) for step, same, n in got] == [(0, True), (1, True)]


def test_prime_rl_steps_arrive_once_in_order_while_the_job_writes(tmp_path):
    src, steps = tmp_path / "outputs/run", 3
    job = PrimeRLJob(src)
    src.mkdir(parents=True)
    follower = Following("prime-rl", src, tmp_path / "logs", writer_progress=lambda: job.stable, **FAST)
    for step in range(steps):
        job.write(step, 0)
        rank0 = job.exporters[0].root / f"step_{step}" / "rank_0.jsonl"
        data = rank0.read_bytes()
        rank0.write_bytes(data[:-40])  # the trainer is in the middle of a line of the step's last record
        time.sleep(0.2)  # the follower polls the unfinished step several times meanwhile
        assert step not in follower.steps
        with rank0.open("ab") as f:
            f.write(data[-40:])
        job.write(step, 1)
        job.finish(step)
        follower.wait_for(step)  # the job goes on only once the step is in the run: it is live
    follower.join()
    assert follower.error is None
    assert follower.steps == list(range(steps))
    assert follower.writer_at == list(range(steps))  # each step was in while the next was not yet written
    assert follower.result.stopped == "stopped"
    assert validate_logdir(tmp_path / "logs") == []
    rows, dup, scalars = counts(tmp_path / "logs")
    assert rows == one_shot("prime-rl", src, tmp_path) and dup == 0 and scalars == dict.fromkeys(range(steps), 1)
    manifest = json.loads((tmp_path / "logs/live/run.json").read_text())
    assert manifest["status"] == "finished" and manifest["mu_source"] == "imported"
    assert manifest["source"]["framework"] == "prime-rl" and "weight-stream" in manifest["source"]["format"]
    with connect(tmp_path / "logs") as db:  # metrics.jsonl and the trace streams came along
        cur = db.cursor()
        losses = [v for _, v in cur.execute("SELECT step, value FROM steps WHERE name = 'loss' ORDER BY step")
                  .fetchall()]
        texts = cur.execute("SELECT count(*) FROM samples WHERE response IS NOT NULL").fetchone()[0]
    assert losses == pytest.approx([0.1 * s for s in range(steps)])
    assert texts == steps * 2 * 6


KILLER = """
import os, signal, sys
from trustscope.importers import follow as F
add = F._Run.add
def add_then_die(self, step, run):
    if step != {kill_step}:
        return add(self, step, run)
    flush = self.loggers[0].flush
    def die():  # the other ranks have committed the step, rank 0 has not: kill -9 now
        os.kill(os.getpid(), signal.SIGKILL)
    self.loggers[0].flush = die
    return add(self, step, run)
F._Run.add = add_then_die
from trustscope.cli import app
sys.argv = ["trustscope", "import", "--follow", "prime-rl", sys.argv[1], sys.argv[2], "--run-id", "live",
            "--poll", "0.05", "--settle", "0", "--stop-after-idle", "30"]
app()
"""


def test_kill_9_mid_step_then_restart_imports_nothing_twice_and_loses_nothing(tmp_path):
    src = tmp_path / "run"
    job = PrimeRLJob(src, ranks=3)
    for step in range(3):
        for rank in range(3):
            job.write(step, rank)
        job.finish(step)
    proc = subprocess.run([sys.executable, "-c", KILLER.format(kill_step=1), str(src), str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "step 0:" in proc.stdout and "step 1:" not in proc.stdout
    killed = rows_per_step(tmp_path / "logs")
    assert set(killed) == {(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)}  # ranks 1 and 2 had committed step 1
    assert json.loads((tmp_path / "logs/live/run.json").read_text())["last_step"] == 0
    result = follow_run("prime-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.2, **FAST)
    assert result.imported == [1, 2]
    rows, dup, scalars = counts(tmp_path / "logs")
    assert rows == one_shot("prime-rl", src, tmp_path) and dup == 0 and scalars == dict.fromkeys(range(3), 1)
    assert validate_logdir(tmp_path / "logs") == []


# ------------------------------------------------------------------------------------------------- NeMo-RL


class NemoRLJob:
    """NeMo-RL's GRPO loop: ``train_data_step<N>.jsonl`` written after each step by ``open(..., "w")`` and one
    ``write`` per line; the lines reach the disk in buffer-sized pieces, so a piece may end inside a line."""

    def __init__(self, log_dir: Path, seed: int = 0):
        self.log_dir, self.rng = log_dir, np.random.default_rng(seed)
        self.staging = log_dir.parent / f".{log_dir.name}-staging"
        self.written = 0

    def write(self, step: int, pause_s: float = 0.0, piece: int = 1500) -> None:
        self.written = step
        write_step(self.staging, step, make_batch(self.rng))
        data = (self.staging / f"train_data_step{step}.jsonl").read_bytes()
        with open(self.log_dir / f"train_data_step{step}.jsonl", "wb") as f:
            for start in range(0, len(data), piece):
                f.write(data[start: start + piece])
                f.flush()
                if pause_s and start + piece < len(data):
                    assert not data[: start + piece].endswith(b"\n")
                    time.sleep(pause_s)


def test_nemo_rl_followed_while_written_then_stopped_and_restarted(tmp_path):
    src = tmp_path / "exp_001"
    src.mkdir()
    job = NemoRLJob(src)
    follower = Following("nemo-rl", src, tmp_path / "logs", writer_progress=lambda: job.written, poll_s=0.05,
                         settle_s=0.3)
    for step in (1, 2):
        job.write(step, pause_s=0.15)  # the follower sees the file end inside a line, several times
        follower.wait_for(step)
    follower.join()
    assert follower.steps == [1, 2] and follower.writer_at == [1, 2]
    first = rows_per_step(tmp_path / "logs")
    for step in (3, 4):  # the job goes on while nothing follows it
        job.write(step)
    result = follow_run("nemo-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.2, **FAST)
    assert result.imported == [3, 4] and result.stopped == "idle"
    (src / "train_data_step5.jsonl").write_bytes(b'{"content": [["user: q0"')  # the next step, being written
    again = CliRunner().invoke(app, ["import", "--follow", "nemo-rl", str(src), str(tmp_path / "logs"), "--run-id",
                                     "live", "--poll", "0.05", "--settle", "0", "--stop-after-idle", "0.1"])
    assert again.exit_code == 0, again.output
    assert "0 step(s) imported this time, steps through 4 in the run (idle)" in again.stdout
    assert "not finished by the writer yet: step(s) 5" in again.stdout
    (src / "train_data_step5.jsonl").unlink()
    final, dup, scalars = counts(tmp_path / "logs")
    assert {k: v for k, v in final.items() if k[0] <= 2} == first
    assert final == one_shot("nemo-rl", src, tmp_path) and dup == 0 and scalars == dict.fromkeys(range(1, 5), 1)
    manifest = json.loads((tmp_path / "logs/live/run.json").read_text())
    assert manifest["status"] == "finished" and len(manifest["resumes"]) == 2


def test_malformed_line_stops_naming_file_and_line_and_keeps_the_committed_steps(tmp_path):
    src = tmp_path / "exp"
    src.mkdir()
    job = NemoRLJob(src)
    for step in (1, 2, 3):
        job.write(step)
    path = src / "train_data_step2.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    good = lines[2]
    lines[2] = b'{"content": [["user: q0", "a2"]], "rewards": [1.0], "token_ids": [[1, 2\n'
    path.write_bytes(b"".join(lines))
    result = CliRunner().invoke(app, ["import", "--follow", "nemo-rl", str(src), str(tmp_path / "logs"),
                                      "--run-id", "live", "--poll", "0.05", "--settle", "0",
                                      "--stop-after-idle", "5"])
    assert result.exit_code == 1
    assert f"{path}:3: not valid JSON" in result.stderr
    assert "step 2 is not imported, steps through 1 are committed" in result.stderr
    assert "step 1:" in result.stdout and "step 2:" not in result.stdout
    assert {s for s, _ in rows_per_step(tmp_path / "logs")} == {1}
    manifest = json.loads((tmp_path / "logs/live/run.json").read_text())
    assert manifest["status"] == "crashed" and "train_data_step2.jsonl:3" in manifest["error"]
    lines[2] = good  # fixed: a restart resumes at the step that stopped it
    path.write_bytes(b"".join(lines))
    result = follow_run("nemo-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.1, **FAST)
    assert result.imported == [2, 3]
    assert rows_per_step(tmp_path / "logs") == one_shot("nemo-rl", src, tmp_path)


def test_source_that_disappears_stops_with_what_was_committed(tmp_path):
    src = tmp_path / "exp"
    src.mkdir()
    job = NemoRLJob(src)
    job.write(1)
    job.write(2)
    follower = Following("nemo-rl", src, tmp_path / "logs", **FAST)
    follower.wait_for(2)
    shutil.rmtree(src)
    follower._thread.join(WAIT_S)
    assert isinstance(follower.error, SourceGone)
    assert str(follower.error) == (f"{src}: disappeared while followed; steps through 2 are committed in "
                                   f"{tmp_path / 'logs/live'}")
    assert {s for s, _ in rows_per_step(tmp_path / "logs")} == {1, 2}
    assert json.loads((tmp_path / "logs/live/run.json").read_text())["status"] == "crashed"


def test_follow_refuses_another_run_and_bad_options(tmp_path):
    src = tmp_path / "exp"
    src.mkdir()
    NemoRLJob(src).write(1)
    import_run("nemo-rl", src, tmp_path / "logs", run_id="once")
    with pytest.raises(FileExistsError, match="not a followed import"):
        follow_run("nemo-rl", src, tmp_path / "logs", run_id="once", stop_after_idle_s=0, **FAST)
    follow_run("nemo-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0, **FAST)
    os.symlink(src, tmp_path / "same")  # the same source, spelled otherwise: resumed
    assert follow_run("nemo-rl", tmp_path / "same", tmp_path / "logs", run_id="live", stop_after_idle_s=0,
                      **FAST).last_step == 1
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError, match=f"is a followed import of nemo-rl {src}; choose another"):
        follow_run("nemo-rl", tmp_path / "other", tmp_path / "logs", run_id="live", stop_after_idle_s=0, **FAST)
    with pytest.raises(SourceGone, match="no such file or directory"):
        follow_run("nemo-rl", tmp_path / "nothing", tmp_path / "logs", stop_after_idle_s=0, **FAST)
    with pytest.raises(ValueError, match="poll_s must be"):
        follow_run("nemo-rl", src, tmp_path / "logs", poll_s=-1, settle_s=0, stop_after_idle_s=0)
    result = CliRunner().invoke(app, ["import", "nemo-rl", str(src), str(tmp_path / "logs"), "--poll", "1"])
    assert result.exit_code == 2 and "--poll is an option of --follow" in result.stderr
    with pytest.raises(ImportUsageError, match="takes no option allow_pickle"):
        follow_run("nemo-rl", src, tmp_path / "logs", allow_pickle=True, stop_after_idle_s=0, **FAST)


def test_follow_reads_the_one_importer_registry(tmp_path):
    """A format registered with ``finished=`` is followed with nothing else added anywhere; one registered without
    it is refused naming the formats that can be; every built-in format declares how its writer finishes a step."""
    from trustscope.importers import IMPORTERS, register_importer
    from trustscope.importers.follow import followed_formats

    assert followed_formats() == list(IMPORTERS) and all(f.finished for f in IMPORTERS.values())
    nemo = IMPORTERS["nemo-rl"]
    src = tmp_path / "exp"
    src.mkdir()
    job = NemoRLJob(src)
    job.write(1)
    job.write(2)
    polled = []

    def finished(path, settle_s, now):  # the format's own knowledge of a finished step, here NeMo-RL's, counted
        polled.append(path)
        return nemo.finished(path, settle_s, now)

    try:
        register_importer("nemo-rl-copy", reads="the same", steps=nemo.steps, combine=nemo.combine,
                          finished=finished)(nemo.read)
        register_importer("nemo-rl-unfollowed", reads="the same")(nemo.read)
        assert followed_formats() == [*list(IMPORTERS)[:-2], "nemo-rl-copy"]
        result = follow_run("nemo-rl-copy", src, tmp_path / "logs", run_id="copy", stop_after_idle_s=0, **FAST)
        assert result.imported == [1, 2] and polled and polled[0] == src
        followed = ", ".join(followed_formats())
        assert followed.endswith("miles, nemo-rl-copy")
        with pytest.raises(ImportFormatError, match=re.escape(f"'nemo-rl-unfollowed' cannot be followed (followed: "
                                                              f"{followed})")):
            follow_run("nemo-rl-unfollowed", src, tmp_path / "logs", stop_after_idle_s=0, **FAST)
    finally:
        IMPORTERS.pop("nemo-rl-copy", None)
        IMPORTERS.pop("nemo-rl-unfollowed", None)
    assert rows_per_step(tmp_path / "logs") == one_shot("nemo-rl", src, tmp_path)


def test_ctrl_c_finishes_the_step_being_imported(tmp_path):
    """SIGINT to ``trustscope import --follow``: it stops after the step in hand, the run is finished, and a
    restart goes on from there."""
    src = tmp_path / "exp"
    src.mkdir()
    job = NemoRLJob(src)
    for step in (1, 2, 3):
        job.write(step)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trustscope.cli", "import", "--follow", "nemo-rl", str(src),
                             str(tmp_path / "logs"), "--run-id", "live", "--poll", "0.05", "--settle", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # the first committed step
    assert line.startswith("step 1:"), proc.stderr.read() if proc.poll() is not None else line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "stopped" in out
    manifest = json.loads((tmp_path / "logs/live/run.json").read_text())
    assert manifest["status"] == "finished"
    result = follow_run("nemo-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.1, **FAST)
    assert result.imported == [s for s in (1, 2, 3) if s > manifest["last_step"]]
    assert rows_per_step(tmp_path / "logs") == one_shot("nemo-rl", src, tmp_path)


# ------------------------------------------------------------------------------------------------- slime


def test_slime_step_waits_for_its_train_dump_and_the_next_one(tmp_path):
    """slime writes each ``.pt`` in place: a rollout step is taken once its train dump exists and a later rollout
    has one too, or once its files have settled."""
    from test_importers_slime import write_dump

    staged, src = tmp_path / "staged", tmp_path / "dump"
    write_dump(staged, steps=3, kind="slime")
    (src / "rollout_data").mkdir(parents=True)
    (src / "train_data").mkdir()

    def publish(rid: int, train: bool = True) -> None:
        names = [f"rollout_data/{rid}.pt"] + ([f"train_data/{rid}.pt"] if train else [])
        for name in names:
            os.replace(staged / name, src / name)
            os.utime(src / name)  # written just now

    publish(0)
    publish(1)
    publish(2, train=False)  # rolled out, not trained yet
    slow = {"poll_s": 0.05, "settle_s": 600.0, "stop_after_idle_s": 0.2}
    first = follow_run("slime", src, tmp_path / "logs", run_id="live", **slow)
    assert first.imported == [0] and first.waiting == [1, 2]
    os.replace(staged / "train_data/2.pt", src / "train_data/2.pt")
    assert follow_run("slime", src, tmp_path / "logs", run_id="live", **slow).imported == [1]
    settled = follow_run("slime", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.2, **FAST)
    assert settled.imported == [2]
    rows, dup, scalars = counts(tmp_path / "logs")
    assert rows == one_shot("slime", src, tmp_path) and dup == 0 and scalars == dict.fromkeys(range(3), 1)


def test_a_step_of_another_writer_version_stops_the_follower(tmp_path):
    """Each step is read alone, so the follower itself refuses a step whose layout differs from the run's."""
    src = tmp_path / "run"
    job = PrimeRLJob(src, ranks=1)
    job.write(0, 0)
    job.finish(0)
    job.exporters = [PrimeRLExporter(src, 0, layout="training-mode")]  # the trainer was upgraded mid-run
    job.write(1, 0)
    job.finish(1)
    with pytest.raises(ImportFormatError, match=r"step 1: prime-rl token_export schema_version 1, training-mode "
                                                r"layout, unlike the steps imported before .*weight-stream.*"
                                                r"step 1 is not imported, steps through 0 are committed"):
        follow_run("prime-rl", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.1, **FAST)
    assert set(rows_per_step(tmp_path / "logs")) == {(0, 0)}


def test_a_followed_slime_dump_carries_its_routed_experts_and_a_restart_keeps_them(tmp_path):
    """Routed experts of a followed dump are logged as a one-shot import logs them, the run's routing_shape
    declared by the first step, and kept by a follower started again."""
    from test_importers_slime import routed_dump

    staged, src = tmp_path / "staged", tmp_path / "dump"
    routed_dump(staged)
    (src / "rollout_data").mkdir(parents=True)
    (src / "train_data").mkdir()
    for name in ("rollout_data/0.pt", "train_data/0.pt"):
        os.replace(staged / name, src / name)
    assert follow_run("slime", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.2, **FAST).imported == [0]
    for name in ("rollout_data/1.pt", "train_data/1.pt"):
        os.replace(staged / name, src / name)
    assert follow_run("slime", src, tmp_path / "logs", run_id="live", stop_after_idle_s=0.2, **FAST).imported == [1]
    import_run("slime", src, tmp_path / "one", run_id="one")
    query = "select step, sample_id, pos, engine_experts from tokens order by step, sample_id, pos"
    with connect(tmp_path / "logs", cache=False) as db:
        live = db.sql(query).to_pandas()
    with connect(tmp_path / "one", cache=False) as db:
        once = db.sql(query).to_pandas()
    assert len(live) == len(once) and live["engine_experts"].notna().all()
    assert [list(e) for e in live["engine_experts"]] == [list(e) for e in once["engine_experts"]]
    assert json.loads((tmp_path / "logs/live/run.json").read_text())["routing_shape"] == [3, 2, 32767]
