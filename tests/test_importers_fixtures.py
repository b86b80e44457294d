"""Each importer on files its framework's own exporter wrote (tests/data/<framework>/, made once from the
framework's source at a named commit; each folder's README says how). The expected rows are read from those files
directly, not through the importer, and compared token by token: every mapped field of the row at (step, sample,
position) against the value the dump holds at that place (mu against the engine's log-prob, pi against the
trainer's), so a field logged from the wrong source, or a value moved to another token, fails."""

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
FLOATS = ("mu_logprob", "pi_logprob", "advantage")


def _tokens(run_dir: Path):
    return pq.ParquetDataset(sorted(str(p) for p in committed_files(run_dir)["tokens"])).read().to_pandas()


def _rows(got, sample_key) -> dict[tuple, dict]:
    """``(step, sample, pos) -> row`` of the imported tokens; ``sample_key(row)`` names the dump's sample."""
    rows = {}
    for row in got.to_dict("records"):
        key = (int(row["step"]), sample_key(row), int(row["pos"]))
        assert key not in rows, f"two rows at {key}"
        rows[key] = row
    return rows


def _same(got: dict[tuple, dict], want: dict[tuple, dict]) -> None:
    """Every expected token is a row at its own place, no other row exists, and each field there equals the dump's
    value at that place (floats as the float32 the logger stores)."""
    assert want and set(got) == set(want), (sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3])
    for key, fields in want.items():
        row = got[key]
        for name, value in fields.items():
            if name in FLOATS or name in ("old_logprob", "entropy"):
                assert row[name] == pytest.approx(float(np.float32(value)), abs=1e-6), (key, name, row[name], value)
            else:
                assert row[name] == value, (key, name, row[name], value)


@pytest.mark.parametrize("layout", ["training-mode", "weight-stream"])
def test_prime_rl_token_export_written_by_prime_rl(layout, tmp_path):
    src = DATA / "prime-rl" / layout
    run_dir = import_run("prime-rl", src, tmp_path / "logs", run_id="p")
    assert validate_logdir(tmp_path / "logs") == []
    want, order = {}, {}  # the exporter's own lines: a step's sequences in rank order, then line order
    for path in sorted(src.glob("token_exports/step_*/rank_*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            sample = order.setdefault(rec["step"], [0])
            on = [t for t, m in enumerate(rec["loss_mask"]) if m]
            for t in on:  # pos 0 = the first trained token
                want[(rec["step"], sample[0], t - on[0])] = {
                    "rank": rec["rank"], "token_id": rec["token_ids"][t], "mu_logprob": rec["inference_logprobs"][t],
                    "pi_logprob": rec["trainer_logprobs"][t], "advantage": rec["advantages"][t],
                    "entropy": rec["entropy"][t], "kept": not rec["is_masked"][t]}
            sample[0] += 1
    got = _tokens(run_dir)
    _same(_rows(got, lambda r: int(r["sample_id"])), want)
    assert not got["kept"].all()  # the DPPO mask is imported, not assumed


def test_nemo_rl_training_data_written_by_nemo_rl(tmp_path):
    src = DATA / "nemo-rl" / "logs"
    run_dir = import_run("nemo-rl", src, tmp_path / "logs", run_id="n")
    assert validate_logdir(tmp_path / "logs") == []
    want = {}
    for path in sorted(src.glob("train_data_step*.jsonl")):
        step = int(path.stem.removeprefix("train_data_step"))
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            n, mask = rec["input_lengths"][0], rec["token_loss_mask"][0]
            on = [t for t in range(n) if mask[t]]
            for t in on:
                want[(step, rec["idx"], t - on[0])] = {
                    "token_id": rec["token_ids"][0][t], "mu_logprob": rec["generation_logprobs"][0][t],
                    "pi_logprob": rec["prev_logprobs"][0][t], "old_logprob": rec["prev_logprobs"][0][t],
                    "advantage": rec["advantages"][0][t], "kept": rec["sample_loss_mask"][0] != 0}
    _same(_rows(_tokens(run_dir), lambda r: int(r["sample_id"])), want)


def _scored(*values: float) -> bool:
    return all(np.isfinite(v) for v in values)


def test_slime_debug_dumps_written_by_slime(tmp_path):
    src = DATA / "slime" / "dump"
    run_dir = import_run("slime", src, tmp_path / "logs", run_id="s")
    assert validate_logdir(tmp_path / "logs") == []
    want = {}
    for path in sorted((src / "rollout_data").glob("*.pt")):
        rollout = torch.load(path, weights_only=True)
        train = torch.load(src / "train_data" / path.name, weights_only=True)
        for trained in train["samples"]:  # removed ones too
            sample = rollout["samples"][trained["rollout_position"]]
            n = sample["response_length"]
            response = sample["tokens"][-n:]
            mu, pi = sample["rollout_log_probs"], trained["log_probs"].tolist()
            adv = trained["advantages"].tolist()
            for t in range(n):  # pos = the place in the response
                if sample["loss_mask"][t] == 1 and _scored(mu[t], pi[t]):
                    want[(rollout["rollout_id"], sample["index"], t)] = {
                        "token_id": response[t], "mu_logprob": mu[t], "pi_logprob": pi[t], "old_logprob": pi[t],
                        "advantage": adv[t], "entropy": float(trained["entropy"][t]),
                        "kept": not sample["remove_sample"]}
    got = _tokens(run_dir)
    _same(_rows(got, lambda r: int(r["sample_id"])), want)
    assert not got["kept"].all()  # the removed sample's tokens


def test_miles_per_rank_dumps_written_by_miles(tmp_path):
    """2 data x 2 context-parallel ranks: the importer puts each response back together from the zigzag slices.
    The test places each slice value by the engine log-prob miles stores beside it in the same slice (unique in
    the fixture), not by the importer's own zigzag arithmetic."""
    src = DATA / "miles" / "dump"
    run_dir = import_run("miles", src, tmp_path / "logs", run_id="m")
    assert validate_logdir(tmp_path / "logs") == []
    samples = {}  # (step, Sample.index) -> the rollout sample
    for path in sorted((src / "rollout_data").glob("*.pt")):
        rollout = torch.load(path, weights_only=True)
        for sample in rollout["samples"]:
            samples[(rollout["rollout_id"], sample["index"])] = sample
    placed: dict[tuple, dict] = {}  # (step, index, response position) -> the trainer's fields there
    values = 0
    for path in sorted((src / "train_data").glob("*.pt")):
        pack = torch.load(path, weights_only=True)
        assert pack["cp_size"] == 2 and pack["qkv_format"] == "thd"
        data = pack["rollout_data"]
        for i, index in enumerate(data["sample_indices"]):
            sample = samples[(pack["rollout_id"], index)]
            engine = np.float32(sample["rollout_log_probs"])
            for j, mu in enumerate(data["rollout_log_probs"][i].tolist()):
                values += 1
                at = np.flatnonzero(np.isclose(engine, mu, rtol=0, atol=1e-6))
                if len(at) > 1:  # the tool tokens' 0.0: never trained, never a row
                    assert not any(sample["loss_mask"][t] for t in at), (index, mu, at)
                    continue
                key = (pack["rollout_id"], index, int(at[0]))
                assert key not in placed, f"{key} in two slices"
                placed[key] = {"pi_logprob": float(data["log_probs"][i][j]),
                               "advantage": float(data["advantages"][i][j])}
    assert values == sum(s["response_length"] for s in samples.values())  # the slices cover each token once
    want = {}
    for (step, index), sample in samples.items():
        n = sample["response_length"]
        response = sample["tokens"][-n:]
        for t in range(n):
            if sample["loss_mask"][t] == 1:
                want[(step, index, t)] = {"token_id": response[t], "mu_logprob": sample["rollout_log_probs"][t],
                                          **placed[(step, index, t)], "kept": not sample["remove_sample"]}
    _same(_rows(_tokens(run_dir), lambda r: int(r["sample_id"])), want)
