"""``trustscope demo``: the toy world end to end in a couple of minutes on a laptop CPU.

Builds the toy model when it is not cached yet, trains a short DPPO (binary TV) run with the logger on and bf16
rollouts against the fp32 trainer (so there is mismatch to look at), and serves the dashboard over the run.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from trustscope.train.config import TrainConfig
from trustscope.train.loop import train_with_progress


def demo_config(logdir: Path, steps: int) -> TrainConfig:
    """The demo run: DPPO binary TV, bf16 vLLM rollouts, two mini-batch updates per step."""
    return TrainConfig(loss="dppo_binary_tv", engine="vllm", engine_dtype="bfloat16", steps=steps,
                       prompts_per_step=8, group_size=8, mini_batches=2, eval_every=10, eval_problems=64,
                       logdir=str(logdir), run_id=f"demo-dppo-{time.strftime('%Y%m%d-%H%M%S')}")


def check_port(host: str, port: int) -> None:
    """Raise OSError naming the port when nothing can listen on ``host:port`` (checked before the demo trains, so
    a busy port is found in a second, not after the run)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"port {port} on {host} is not free ({exc.strerror}); pick another with --port") from None


def run_demo(logdir: Path, steps: int = 30, serve: bool = True, port: int = 8501) -> Path:
    """Train the demo run into ``logdir`` and, when ``serve``, replace this process with the dashboard (its port
    checked first)."""
    if serve:
        check_port("127.0.0.1", port)
    cfg = demo_config(Path(logdir), steps)
    train_with_progress(cfg)
    if serve:
        from app.launch import launch

        launch(Path(logdir), port=port)
    return cfg.run_dir
