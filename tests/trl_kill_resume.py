"""A TRL GRPO run with trustscope attached that checkpoints every 2 steps, run as its own process: with ``kill``
it SIGKILLs itself in the middle of step 3 (inside the policy's training forward, after step 2 was logged), and
with ``resume`` it continues from TRL's newest checkpoint with ``resume_from_checkpoint=True`` and
``attach(resume=True)``. Used by tests/test_integration_trl.py.

    python tests/trl_kill_resume.py MODEL_DIR WORK kill|resume|whole
"""

import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trustscope.integrations.trl import attach
from trustscope.train.tasks import get_task

TASK = get_task("add1")
STEPS, PROMPTS, GROUP = 4, 4, 4


def reward(completions, answer, **kwargs):
    return [TASK.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]


def main(model_dir: str, work: str, mode: str) -> None:
    problems = TASK.split("train")[: PROMPTS * STEPS]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    args = GRPOConfig(output_dir=os.path.join(work, "out"), max_steps=STEPS, per_device_train_batch_size=PROMPTS * GROUP,
                      num_generations=GROUP, max_completion_length=8, learning_rate=1e-3, beta=0.0,
                      num_iterations=2, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                      use_cpu=True, bf16=False, disable_tqdm=True, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    if mode == "kill":
        def die(module, inputs, output):
            if trainer.state.global_step == 3 and torch.is_grad_enabled() and module.training:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.model.register_forward_hook(die)
    attach(trainer, os.path.join(work, "logs"), run_id="killed", resume=mode == "resume", metrics=False)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)


if __name__ == "__main__":
    main(*sys.argv[1:4])
