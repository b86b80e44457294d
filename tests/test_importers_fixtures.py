"""Each importer on files its framework's own exporter wrote (tests/data/<framework>/, made once from the
framework's source at a named commit; each folder's README says how). The expected values are read from those
files directly, not through the importer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trustscope.importers import import_run
from trustscope.runformat.commits import committed_files
from trustscope.runformat.validation import validate_logdir

DATA = Path(__file__).resolve().parent / "data"


def _tokens(run_dir: Path):
    return pq.ParquetDataset(sorted(str(p) for p in committed_files(run_dir)["tokens"])).read().to_pandas()


@pytest.mark.parametrize("layout", ["training-mode", "weight-stream"])
def test_prime_rl_token_export_written_by_prime_rl(layout, tmp_path):
    src = DATA / "prime-rl" / layout
    run_dir = import_run("prime-rl", src, tmp_path / "logs", run_id="p")
    assert validate_logdir(tmp_path / "logs") == []
    want = []  # (step, rank, mu, pi, kept) of every loss-mask token, from the exporter's own lines
    for path in sorted(src.glob("token_exports/step_*/rank_*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for t, on in enumerate(rec["loss_mask"]):
                if on:
                    want.append((rec["step"], rec["rank"], rec["inference_logprobs"][t], rec["trainer_logprobs"][t],
                                 not rec["is_masked"][t]))
    got = _tokens(run_dir)
    assert len(got) == len(want) > 0 and set(got["step"]) == {s for s, *_ in want}
    got = got.sort_values(["step", "rank", "mu_logprob"])
    want = sorted(want, key=lambda w: (w[0], w[1], np.float32(w[2])))
    np.testing.assert_allclose(got["mu_logprob"], [w[2] for w in want], atol=1e-6)
    np.testing.assert_allclose(got["pi_logprob"], [w[3] for w in want], atol=1e-6)
    assert got["kept"].tolist() == [w[4] for w in want] and not got["kept"].all()


def test_nemo_rl_training_data_written_by_nemo_rl(tmp_path):
    src = DATA / "nemo-rl" / "logs"
    run_dir = import_run("nemo-rl", src, tmp_path / "logs", run_id="n")
    assert validate_logdir(tmp_path / "logs") == []
    mu = []
    for path in sorted(src.glob("train_data_step*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            n, mask, gen = rec["input_lengths"][0], rec["token_loss_mask"][0], rec["generation_logprobs"][0]
            mu += [gen[t] for t in range(n) if mask[t]]
    got = _tokens(run_dir)
    assert len(got) == len(mu) > 0
    np.testing.assert_allclose(np.sort(got["mu_logprob"]), np.sort(np.float32(mu)), atol=1e-6)


def test_slime_debug_dumps_written_by_slime(tmp_path):
    src = DATA / "slime" / "dump"
    run_dir = import_run("slime", src, tmp_path / "logs", run_id="s")
    assert validate_logdir(tmp_path / "logs") == []
    mu, pi = [], []
    for path in sorted((src / "rollout_data").glob("*.pt")):
        rollout = torch.load(path, weights_only=True)
        train = torch.load(src / "train_data" / path.name, weights_only=True)
        for sample, trained in zip(rollout["samples"], train["samples"], strict=True):  # removed ones too
            keep = np.array(sample["loss_mask"]) == 1
            mu += np.array(sample["rollout_log_probs"])[keep].tolist()
            pi += trained["log_probs"].numpy()[keep].tolist()
    got = _tokens(run_dir)
    assert len(got) == len(mu) > 0
    np.testing.assert_allclose(np.sort(got["mu_logprob"]), np.sort(np.float32(mu)), atol=1e-6)
    np.testing.assert_allclose(np.sort(got["pi_logprob"]), np.sort(np.float32(pi)), atol=1e-6)


def test_miles_per_rank_dumps_written_by_miles(tmp_path):
    """2 data x 2 context-parallel ranks: the importer puts each response back together from the zigzag slices."""
    src = DATA / "miles" / "dump"
    run_dir = import_run("miles", src, tmp_path / "logs", run_id="m")
    assert validate_logdir(tmp_path / "logs") == []
    mu, slices, n_response = [], [], 0
    for path in sorted((src / "rollout_data").glob("*.pt")):
        for sample in torch.load(path, weights_only=True)["samples"]:
            n_response += sample["response_length"]
            keep = np.array(sample["loss_mask"]) == 1
            mu += np.array(sample["rollout_log_probs"])[keep].tolist()
    for path in sorted((src / "train_data").glob("*.pt")):
        pack = torch.load(path, weights_only=True)
        assert pack["cp_size"] == 2 and pack["qkv_format"] == "thd"
        slices += [float(v) for part in pack["rollout_data"]["log_probs"] for v in part]
    assert len(slices) == n_response  # the zigzag slices cover each response token once
    got = _tokens(run_dir)
    assert len(got) == len(mu) > 0
    np.testing.assert_allclose(np.sort(got["mu_logprob"]), np.sort(np.float32(mu)), atol=1e-6)
    assert set(np.round(got["pi_logprob"], 5)) <= set(np.round(np.float32(slices), 5))  # pi from the CP slices
