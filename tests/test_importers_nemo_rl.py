"""NeMo-RL importer, on ``train_data_step<N>.jsonl`` files written the way NeMo-RL's GRPO loop writes them.

``write_step`` follows ``nemo_rl/algorithms/grpo.py`` (the "Log training data" block) and
``Logger.log_batched_dict_as_jsonl`` (``nemo_rl/utils/logger.py``): a batch of right-padded ``(B, T)`` tensors
(``T`` rounded up to ``make_sequence_length_divisible_by``), cut into batches of one, ``tolist()``, then
``json.dumps({**sample, "idx": i}, default=str)``, which writes NaN and infinities bare.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trustscope.importers import ImportFormatError, import_run
from trustscope.runformat.validation import validate_logdir

V, PAD = 40, 0


def make_batch(rng: np.random.Generator, n: int = 8, group: int = 4, divisible_by: int = 8) -> dict:
    """One step's ``log_data`` as GRPO builds it; also returns the per-sample ground truth under ``"truth"``."""
    seqs, truth = [], []
    for i in range(n):
        if i % group == 0:
            prompt = rng.integers(1, V, int(rng.integers(3, 6))).tolist()
            rewards = rng.integers(0, 2, group).astype(float)
            adv = rewards - rewards.mean()
        gen1 = rng.integers(1, V, int(rng.integers(3, 7))).tolist()
        tool = rng.integers(1, V, 2).tolist() if i % 3 == 0 else []
        gen2 = rng.integers(1, V, 3).tolist() if tool else []
        tokens = prompt + gen1 + tool + gen2
        mask = [0] * len(prompt) + [1] * len(gen1) + [0] * len(tool) + [1] * len(gen2)
        mu = np.where(np.array(mask) == 1, np.log(rng.uniform(0.05, 1.0, len(tokens))), 0.0)
        prev = np.minimum(mu + rng.normal(0, 0.1, len(tokens)), 0.0)
        prev[0] = 0.0  # NeMo-RL's convention: the first token's log-prob is 0
        content = [f"user: q{i // group}", f"a{i}"] + ([f"tool{i}", f"b{i}"] if tool else [])
        seqs.append((tokens, mask, mu, prev, content))
        truth.append({"tokens": tokens, "mask": mask, "mu": mu, "prev": prev, "adv": adv[i % group],
                      "reward": rewards[i % group], "content": content, "sample_mask": 0.0 if i == 6 else 1.0})
    width = -(-max(len(s[0]) for s in seqs) // divisible_by) * divisible_by
    B = len(seqs)
    token_ids = torch.full((B, width), PAD, dtype=torch.long)
    token_mask = torch.zeros((B, width), dtype=torch.long)
    gen_lp = torch.zeros((B, width), dtype=torch.float32)
    prev_lp = torch.tensor(rng.normal(-3, 1, (B, width)), dtype=torch.float32)  # padding: whatever the forward gave
    for b, (tokens, mask, mu, prev, _) in enumerate(seqs):
        n_b = len(tokens)
        token_ids[b, :n_b] = torch.tensor(tokens)
        token_mask[b, :n_b] = torch.tensor(mask)
        gen_lp[b, :n_b] = torch.tensor(mu, dtype=torch.float32)
        prev_lp[b, :n_b] = torch.tensor(prev, dtype=torch.float32)
    advantages = torch.tensor([t["adv"] for t in truth], dtype=torch.float32)[:, None].expand(B, width)
    return {
        "content": [s[4] for s in seqs],
        "rewards": torch.tensor([t["reward"] for t in truth]),
        "input_lengths": torch.tensor([len(s[0]) for s in seqs], dtype=torch.int32),
        "token_ids": token_ids, "token_loss_mask": token_mask,
        "sample_loss_mask": torch.tensor([t["sample_mask"] for t in truth]),
        "advantages": advantages, "generation_logprobs": gen_lp, "prev_logprobs": prev_lp,
        "truth": truth,
    }


def write_step(log_dir: Path, step: int, log_data: dict) -> None:
    """``Logger.log_batched_dict_as_jsonl(log_data, f"train_data_step{step}.jsonl")``."""
    data = {k: v for k, v in log_data.items() if k != "truth"}
    n = len(data["content"])
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"train_data_step{step}.jsonl", "w") as f:
        for i in range(n):
            sample = {k: v[i: i + 1] for k, v in data.items()}
            for key, value in sample.items():
                if isinstance(value, torch.Tensor):
                    sample[key] = value.tolist()
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")


def write_log_dir(log_dir: Path, steps: int = 2, seed: int = 0, unscored: bool = True) -> dict[int, dict]:
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(1, steps + 1):
        batch = make_batch(rng)
        if unscored:
            first_gen = batch["truth"][1]["mask"].index(1)
            batch["generation_logprobs"][1, first_gen] = float("-inf")  # written as -Infinity
            batch["prev_logprobs"][2, batch["truth"][2]["mask"].index(1) + 1] = float("nan")  # written as NaN
        write_step(log_dir, step, batch)
        out[step] = batch
    return out


def test_train_data_steps_import_exactly(tmp_path):
    written = write_log_dir(tmp_path / "logs_nemo")
    assert "NaN" in (tmp_path / "logs_nemo/train_data_step1.jsonl").read_text()
    run_dir = import_run("nemo-rl", tmp_path / "logs_nemo", tmp_path / "logs", run_id="n", version="0.6.0")
    assert validate_logdir(tmp_path / "logs") == []
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["source"] == {"framework": "nemo-rl", "version": "0.6.0",
                                  "format": "nemo-rl grpo train_data_step<N>.jsonl",
                                  "src": str(tmp_path / "logs_nemo")}
    assert manifest["config"]["import"]["unscored_tokens"] == 4
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    samples = pq.read_table(run_dir / "samples").to_pandas()
    assert sorted(tokens.step.unique()) == [1, 2]
    assert len(tokens) == sum(sum(t["mask"]) for b in written.values() for t in b["truth"]) - 4
    t = written[2]["truth"][3]
    first = t["mask"].index(1)
    keep = [p - first for p in range(len(t["tokens"])) if t["mask"][p]]
    got = tokens[(tokens.step == 2) & (tokens.sample_id == 3)].sort_values("pos")
    assert got.pos.tolist() == keep
    sel = np.array(t["mask"]) == 1
    assert got.token_id.tolist() == np.array(t["tokens"])[sel].tolist()
    assert np.allclose(got.mu_logprob, t["mu"][sel].astype(np.float32))
    assert np.allclose(got.pi_logprob, t["prev"][sel].astype(np.float32))
    assert np.allclose(got.old_logprob, got.pi_logprob)
    assert np.allclose(got.advantage, t["adv"])
    assert got.entropy.isna().all()
    assert not tokens[(tokens.step == 1) & (tokens.sample_id == 6)].kept.any()  # sample_loss_mask 0
    assert tokens[(tokens.step == 1) & (tokens.sample_id == 5)].kept.all()
    row = samples[(samples.step == 2) & (samples.sample_id == 3)].iloc[0]
    assert row.reward == t["reward"] and row.response == t["content"][-1]
    assert (samples.groupby(["step", "prompt_id"]).size() == 4).all()


def _fails(src: Path, logdir: Path, match: str) -> None:
    with pytest.raises(ImportFormatError, match=match):
        import_run("nemo-rl", src, logdir, run_id="bad")
    assert not logdir.exists() or list(logdir.iterdir()) == []


def test_truncated_file_names_file_and_line(tmp_path):
    write_log_dir(tmp_path / "nemo")
    path = tmp_path / "nemo/train_data_step2.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    line = data[:-100].count(b"\n") + 1
    _fails(tmp_path / "nemo", tmp_path / "logs", rf"train_data_step2\.jsonl:{line}: ")


def _edit_line(path: Path, number: int, edit) -> None:
    lines = path.read_text().splitlines()
    record = json.loads(lines[number - 1])
    edit(record)
    lines[number - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.pop("prev_logprobs"), r"missing \['prev_logprobs'\]"),
    (lambda r: r.update(advantages=[r["advantages"][0][:-1]]), r"'advantages' has length"),
    (lambda r: r.update(rewards=r["rewards"] * 2), r"'rewards' must be a batch of one"),
    (lambda r: r.update(input_lengths=[10_000]), r"input_lengths 10000 outside"),
])
def test_wrong_line_names_file_and_line(tmp_path, edit, match):
    write_log_dir(tmp_path / "nemo")
    _edit_line(tmp_path / "nemo/train_data_step1.jsonl", 4, edit)
    _fails(tmp_path / "nemo", tmp_path / "logs", rf"train_data_step1\.jsonl:4: .*{match}")


def test_keys_nemo_rl_does_not_write_are_kept_as_columns(tmp_path):
    """A key of a newer or forked writer (a batch of one, like every key): a per-token list becomes a column cut
    to the rows, a number is broadcast over its response; what no column takes is named and left out."""
    write_log_dir(tmp_path / "nemo")
    for path in (tmp_path / "nemo").glob("train_data_step*.jsonl"):
        for n in range(1, len(path.read_text().splitlines()) + 1):
            _edit_line(path, n, lambda r: r.update(teacher_logprobs=r["prev_logprobs"], judge_score=[0.5],
                                                   token_level_logprobs=[]))
    with pytest.warns(ImportWarning, match=r"kept as the run's own columns: judge_score \(float64\), "
                                           r"teacher_logprobs \(float64\); left out: token_level_logprobs \(not a "
                                           r"batch of one"):
        run_dir = import_run("nemo-rl", tmp_path / "nemo", tmp_path / "logs", run_id="n")
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    assert len(tokens) > 0 and tokens["judge_score"].eq(0.5).all()
    np.testing.assert_allclose(tokens["teacher_logprobs"], tokens["pi_logprob"], atol=1e-6)


def test_mixed_configurations_are_refused(tmp_path):
    write_log_dir(tmp_path / "nemo")
    path = tmp_path / "nemo/train_data_step2.jsonl"
    for n in range(1, 9):
        _edit_line(path, n, lambda r: r.update(filtered_rewards=r["rewards"]))
    _fails(tmp_path / "nemo", tmp_path / "logs", r"step2\.jsonl:1: optional keys \['filtered_rewards'\], unlike .*"
                                                 r"step1\.jsonl:1 \(optional keys \[\]\): .* mixed")


def test_skipped_prev_logprobs_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    batch = make_batch(rng)
    batch["prev_logprobs"] = torch.zeros_like(batch["generation_logprobs"])  # force_on_policy_ratio
    write_step(tmp_path / "nemo", 1, batch)
    _fails(tmp_path / "nemo", tmp_path / "logs", r"prev_logprobs are 0 on every trained token")
