"""What the TRL subprocess scripts (tests/trl_vllm_run.py, tests/trl_vllm_server_run.py) share: the add1 task's
data and reward, one GRPO configuration with vLLM in the mode each script gives, attach(topk=4), and TRL's
``state.log_history`` written beside the run. Import it after the script has set its environment: it imports TRL."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trustscope.integrations.trl import attach
from trustscope.train.tasks import get_task

TASK = get_task("add1")


def reward(completions, answer, **kwargs):
    return [TASK.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]


def attached_trainer(model_dir: str, work: str, run_id: str, **vllm) -> GRPOTrainer:
    """A 4-step GRPOTrainer on 16 add1 prompts with ``use_vllm=True`` and ``vllm`` (the mode and its settings),
    attached with topk=4 to ``work/logs/run_id``."""
    problems = TASK.split("train")[:16]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    args = GRPOConfig(output_dir=os.path.join(work, "out"), max_steps=4, per_device_train_batch_size=16,
                      num_generations=4, max_completion_length=8, learning_rate=1e-3, beta=0.0, num_iterations=2,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
                      seed=0, shuffle_dataset=False, use_vllm=True, **vllm)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    attach(trainer, os.path.join(work, "logs"), topk=4, run_id=run_id)
    return trainer


def train(trainer: GRPOTrainer, work: str) -> None:
    """Train, then write TRL's ``state.log_history`` to ``work/log_history.json``."""
    trainer.train()
    with open(os.path.join(work, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
