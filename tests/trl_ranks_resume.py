"""A TRL GRPO run with trustscope attached, started by torchrun on CPU processes (gloo): with ``first`` it trains
steps 0-2 and checkpoints at step 2 (TRL's checkpoint-2 holds steps 0-1); with ``resume`` it continues from that
checkpoint (``resume_from_checkpoint=<checkpoint-2>``, ``attach(resume=True)``) to step 4, on however many processes torchrun
starts this time. Used by tests/test_trl_resume_ranks.py.

    python -m torch.distributed.run --nproc_per_node N tests/trl_ranks_resume.py MODEL_DIR WORK first|resume
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trustscope.integrations.trl import attach
from trustscope.logger import LogWarning
from trustscope.train.tasks import get_task

TASK = get_task("add1")
PROMPTS, GROUP = 2, 4


def reward(completions, answer, **kwargs):
    return [TASK.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]


def main(model_dir: str, work: str, mode: str) -> None:
    problems = TASK.split("train")[:64]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    args = GRPOConfig(output_dir=os.path.join(work, "out"), max_steps=3 if mode == "first" else 4,
                      per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP, max_completion_length=6,
                      learning_rate=1e-3, beta=0.0, num_iterations=2, logging_steps=1, save_strategy="steps",
                      save_steps=2, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                      shuffle_dataset=False)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogWarning)
        attach(trainer, os.path.join(work, "logs"), run_id="ranks", resume=mode == "resume", metrics=False)
        trainer.train(resume_from_checkpoint=os.path.join(work, "out", "checkpoint-2") if mode == "resume" else None)
    said = [str(w.message) for w in caught if issubclass(w.category, LogWarning)
            and "trainer_recompute" not in str(w.message)]
    rank = trainer.accelerator.process_index
    with open(os.path.join(work, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"warnings": said, "world": trainer.accelerator.num_processes,
                   "global_step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
