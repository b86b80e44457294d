"""A verl ``RayPPOTrainer`` (verl's own ``_update_actor``, one in-process actor as in tests/test_integration_verl.py)
with trustscope attached, run as its own process over steps 1-4 with a checkpoint after step 2: ``kill``
SIGKILLs itself in the middle of step 3's actor update (after its first micro-batch was logged), ``resume``
continues at step 3 as verl does after restoring ``global_step_2`` (``attach(resume=True)``), ``whole`` runs the
four steps uninterrupted. Used by tests/test_integration_verl.py.

    python tests/verl_kill_resume.py LOGDIR kill|resume|whole
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_integration_verl import LocalActorGroup, local_trainer, make_batch, ppo_config

from trustscope.integrations import verl as tv


def settled(run_dir: Path, step: int, timeout_s: float = 120.0) -> None:
    """Wait until every rank's manifest commits ``step``: commits are the writer threads' (the training never waits
    on them), so the kill lands after the checkpoint's step is on disk, the case this script stands for (a log that
    ends before the checkpoint is a ``resume_log_short`` incident, tests/test_logger_incidents.py)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ranks = [json.loads(p.read_text()) for p in [run_dir / "run.json", *(run_dir / "ranks").glob("*.json")]]
        except (OSError, ValueError):
            ranks = []
        if len(ranks) >= 2 and all(r.get("last_step") is not None and r["last_step"] >= step for r in ranks):
            return
        time.sleep(0.02)


class KilledActorGroup(LocalActorGroup):
    """The local actor, killed with SIGKILL after its first micro-batch of step ``kill_at``."""

    def __init__(self, pi, kill_at):
        super().__init__(pi)
        self.kill_at, self.step = kill_at, None

    def update_actor(self, data):
        hook, calls = self.loss_fn, []

        def loss_fn(**kw):
            if calls and self.step == self.kill_at:
                settled(Path(sys.argv[1]) / "killed", self.kill_at - 1)
                os.kill(os.getpid(), signal.SIGKILL)
            calls.append(1)
            return hook(**kw)

        self.loss_fn = loss_fn
        try:
            return super().update_actor(data)
        finally:
            self.loss_fn = hook


def main(logdir: str, mode: str) -> None:
    first = 3 if mode == "resume" else 1
    group = KilledActorGroup(make_batch(B=8, seed=0)[1], kill_at=3 if mode == "kill" else None)
    trainer = local_trainer(ppo_config(), group)
    trainer._save_checkpoint = lambda: None  # verl's own writes the model; the log's side is what is tested
    with tv.attach(trainer, logdir, run_id="killed", resume=mode == "resume"):
        for step in range(first, 5):
            batch, pi = make_batch(B=8, seed=step)
            group.pi, group.step, trainer.global_steps = pi, step, step
            trainer._update_actor(batch)
            if step == 2:
                trainer._save_checkpoint()


if __name__ == "__main__":
    main(*sys.argv[1:3])
