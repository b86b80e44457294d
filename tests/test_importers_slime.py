"""slime / miles ``--dump-details`` importer, on dumps written the way those frameworks write them.

Rollout side: ``torch.save({"rollout_id", ["metadata"], "samples": [Sample.to_dict()]})`` (slime
``rollout_data_utils.save_debug_rollout_data``, miles ``ray/rollout/debug_data.save_debug_rollout_data``).
Train side, miles: one ``<id>_<rank>.pt`` per rank with the rank's DP shard, per-token trainer fields holding the
rank's context-parallel zigzag slice (``cp_utils.slice_log_prob_with_cp``), TP peers writing copies and pipeline
stages before the last holding no trainer fields (``train_dump_utils.save_debug_train_data_for_rank``). Train side,
slime since #2266: one ``<id>.pt``, ``format_version`` 2, CP fields restored (``train_data_utils._build_dump_payload``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trustscope.importers import ImportFormatError, import_run
from trustscope.importers.slime import assemble_cp
from trustscope.runformat.validation import validate_logdir

V = 50


def make_samples(rng: np.random.Generator, rollout_id: int, n: int = 8, group: int = 4) -> list[dict]:
    """``Sample.to_dict()`` of ``n`` responses, ``group`` per prompt; every third one has a tool turn (mask 0)."""
    out = []
    for i in range(n):
        if i % group == 0:
            prompt_ids = rng.integers(0, V, int(rng.integers(3, 7))).tolist()
            rewards = rng.integers(0, 2, group).astype(float).tolist()
        length = int(rng.integers(4, 11))
        mask = [1] * length
        if i % 3 == 2:
            mask[1:3] = [0, 0]
        lp = np.log(rng.uniform(0.05, 1.0, length)).astype(np.float32)
        lp[np.array(mask) == 0] = 0.0  # the engine never scored tool tokens: 0.0 placeholders
        out.append({
            "group_index": rollout_id * 100 + i // group, "index": rollout_id * 1000 + i, "rollout_id": rollout_id,
            "prompt": [{"role": "user", "content": f"question {i // group}"}],
            "tokens": prompt_ids + rng.integers(0, V, length).tolist(), "multimodal_inputs": None,
            "multimodal_train_inputs": None, "response": f"answer {i}", "response_length": length, "label": "1",
            "reward": rewards[i % group], "loss_mask": mask,
            # slime pushes version 1 before rollout 0 and one more after each step; sample 3 is a partial rollout
            # begun one version earlier and continued with the newest weights
            "weight_versions": [str(rollout_id), str(rollout_id + 1)] if i == 3 and rollout_id else [str(rollout_id + 1)],
            "rollout_log_probs": lp.tolist(), "rollout_routed_experts": None, "rollout_indexer_topk": None,
            "remove_sample": i == 5, "teacher_log_probs": None, "opd_reverse_kl": None,
            "status": "truncated" if i == 1 else "completed", "metadata": {}, "generate_function_path": None,
            "train_metadata": None, "adapter": None, "reward_spec": None, "routing_key": None,
            "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
        })
    return out


def trainer_fields(rng: np.random.Generator, samples: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Full-length trainer fields per sample, as the actor computes them before CP slicing is undone."""
    out = []
    for s in samples:
        n = s["response_length"]
        mu = torch.tensor(s["rollout_log_probs"])
        adv = torch.full((n,), float(s["reward"]) - 0.5)
        out.append({"log_probs": torch.clamp(mu + torch.tensor(rng.normal(0, 0.05, n), dtype=torch.float32), max=0),
                    "ref_log_probs": mu.clone(), "advantages": adv, "returns": adv.clone(),
                    "entropy": torch.tensor(rng.uniform(0.1, 2.0, n), dtype=torch.float32)})
    return out


def zigzag_slice(values: torch.Tensor, total: int, resp: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """What CP rank ``cp_rank`` holds of a response-length tensor (miles' ``slice_log_prob_with_cp``, thd)."""
    prompt = total - resp
    chunk = (total + 2 * cp_size - 1) // (2 * cp_size)
    parts = []
    for c in (cp_rank, 2 * cp_size - cp_rank - 1):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total - 1)
        if lo < hi:
            parts.append(values[lo - (prompt - 1): hi - (prompt - 1)])
    return torch.cat(parts) if parts else values[:0]


def write_rollout(dump: Path, rid: int, samples: list[dict], miles: bool = True) -> None:
    (dump / "rollout_data").mkdir(parents=True, exist_ok=True)
    payload = {"rollout_id": rid, "metadata": {}, "samples": samples} if miles else {"rollout_id": rid,
                                                                                   "samples": samples}
    torch.save(payload, dump / "rollout_data" / f"{rid}.pt")


def write_miles_train(dump: Path, rid: int, samples: list[dict], fields: list[dict], tp: int = 2, cp: int = 2,
                      dp: int = 2, pp: int = 2, record_cp: bool = True) -> None:
    """Per-rank train files of a TP x CP x DP x PP job, Megatron's rank order tp-cp-dp-pp."""
    (dump / "train_data").mkdir(parents=True, exist_ok=True)
    raw_reward = [s["reward"] for s in samples]
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            shard = list(range(dp_rank, len(samples), dp))
            for cp_rank in range(cp):
                for tp_rank in range(tp):
                    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
                    mine = [samples[i] for i in shard]
                    data = {
                        "tokens": [torch.tensor(s["tokens"], dtype=torch.long) for s in mine],
                        "loss_masks": [torch.tensor(s["loss_mask"], dtype=torch.int) for s in mine],
                        "total_lengths": [len(s["tokens"]) for s in mine],
                        "response_lengths": [s["response_length"] for s in mine],
                        "sample_indices": [s["index"] for s in mine],
                        "rewards": [s["reward"] - 0.5 for s in mine],
                        "raw_reward": raw_reward,
                        "truncated": [int(s["status"] == "truncated") for s in mine],
                    }
                    names = ["rollout_log_probs"] + (list(fields[0]) if pp_rank == pp - 1 else [])
                    for name in names:
                        data[name] = []
                        for i in shard:
                            s = samples[i]
                            full = torch.tensor(s["rollout_log_probs"]) if name == "rollout_log_probs" \
                                else fields[i][name]
                            data[name].append(zigzag_slice(full, len(s["tokens"]), s["response_length"], cp_rank, cp)
                                              if cp > 1 else full)
                    pack = {"rollout_id": rid, "rank": rank, "rollout_data": data}
                    if record_cp:
                        pack.update(cp_rank=cp_rank, cp_size=cp, qkv_format="thd")
                    torch.save(pack, dump / "train_data" / f"{rid}_{rank}.pt")


def write_slime_train(dump: Path, rid: int, samples: list[dict], fields: list[dict], dp: int = 2) -> None:
    """slime's single-file format 2: samples in rollout order, CP fields at full length."""
    (dump / "train_data").mkdir(parents=True, exist_ok=True)
    out, shards = [], []
    for dp_rank in range(dp):
        shard = list(range(dp_rank, len(samples), dp))
        shards.append({"rank": dp_rank * 2, "data_parallel_rank": dp_rank,
                       "sample_indices": [samples[i]["index"] for i in shard], "partition": shard,
                       "micro_batch_indices": [[list(range(len(shard)))]], "num_microbatches": [1],
                       "global_batch_sizes": [len(samples)]})
        for i in shard:
            s = samples[i]
            out.append({"data_parallel_rank": dp_rank, "sample_index": s["index"], "rollout_position": i,
                        "tokens": torch.tensor(s["tokens"]), "total_lengths": len(s["tokens"]),
                        "response_lengths": s["response_length"], "loss_masks": torch.tensor(s["loss_mask"]),
                        "rewards": s["reward"] - 0.5, "rollout_log_probs": torch.tensor(s["rollout_log_probs"]),
                        **fields[i]})
    out.sort(key=lambda d: d["rollout_position"])
    torch.save({"format_version": 2, "rollout_id": rid, "rank": 0, "samples": out, "dp_shards": shards,
                "raw_reward": [s["reward"] for s in samples]}, dump / "train_data" / f"{rid}.pt")


def write_dump(dump: Path, steps: int = 2, kind: str = "miles", seed: int = 0, **kw) -> dict[int, tuple]:
    rng = np.random.default_rng(seed)
    written = {}
    for rid in range(steps):
        samples = make_samples(rng, rid)
        fields = trainer_fields(rng, samples)
        write_rollout(dump, rid, samples, miles=kind == "miles")
        if kind == "miles":
            write_miles_train(dump, rid, samples, fields, **kw)
        else:
            write_slime_train(dump, rid, samples, fields, **kw)
        written[rid] = (samples, fields)
    return written


def _check_values(run_dir: Path, written: dict) -> None:
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    samples = pq.read_table(run_dir / "samples").to_pandas()
    n_rows = 0
    for rid, (ss, fields) in written.items():
        for s, f in zip(ss, fields, strict=True):
            keep = np.flatnonzero(np.array(s["loss_mask"]) > 0)
            n_rows += len(keep)
            got = tokens[(tokens.step == rid) & (tokens.sample_id == s["index"])].sort_values("pos")
            assert got.pos.tolist() == keep.tolist()
            assert got.token_id.tolist() == np.array(s["tokens"][-s["response_length"]:])[keep].tolist()
            assert np.allclose(got.mu_logprob, np.array(s["rollout_log_probs"], np.float32)[keep])
            assert np.allclose(got.pi_logprob, f["log_probs"].numpy()[keep])
            assert np.allclose(got.old_logprob, f["log_probs"].numpy()[keep])
            assert np.allclose(got.advantage, f["advantages"].numpy()[keep])
            assert got.kept.tolist() == [not s["remove_sample"]] * len(keep)
            versions = [int(v) - 1 for v in s["weight_versions"]]
            assert got.policy_version.tolist() == [versions[0]] * len(keep)
            assert got.policy_version_last.tolist() == [versions[-1]] * len(keep)
            row = samples[(samples.step == rid) & (samples.sample_id == s["index"])].iloc[0]
            assert row.reward == s["reward"] and row.response == s["response"]
            assert row.finish_reason == s["status"] and row.prompt == f"user: {s['prompt'][0]['content']}"
    assert len(tokens) == n_rows
    # one prompt id per GRPO group within a step
    assert (samples.groupby(["step", "prompt_id"]).size() == 4).all()


def test_miles_per_rank_dump_with_tp_cp_dp_pp(tmp_path):
    written = write_dump(tmp_path / "dump")
    assert len(list((tmp_path / "dump/train_data").iterdir())) == 2 * 16
    run_dir = import_run("miles", tmp_path / "dump", tmp_path / "logs", run_id="m", version="0.1.0")
    assert validate_logdir(tmp_path / "logs") == []
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["mu_source"] == "imported"
    assert manifest["source"]["framework"] == "miles" and manifest["source"]["version"] == "0.1.0"
    assert "cp_rank recorded" in manifest["source"]["format"]
    assert "pi_old" in manifest["config"]["import"]["columns"]["pi_logprob"]
    _check_values(run_dir, written)


def test_slime_single_file_dump(tmp_path):
    written = write_dump(tmp_path / "dump", kind="slime")
    run_dir = import_run("slime", tmp_path / "dump", tmp_path / "logs")
    assert validate_logdir(run_dir) == []
    assert json.loads((run_dir / "run.json").read_text())["source"]["framework"] == "slime"
    _check_values(run_dir, written)


def test_weight_versions_that_are_no_push_of_the_run_are_refused_naming_the_sample(tmp_path):
    for bad, match in (("v7", r"weight version 'v7' is not an integer"),
                       ("5", r"weight version '5' is not a push before rollout 1")):
        dump = tmp_path / bad
        written = write_dump(dump, steps=2)
        samples, _ = written[1]
        samples[2]["weight_versions"] = [bad]
        write_rollout(dump, 1, samples)
        _fails("miles", dump, tmp_path / f"logs-{bad}", r"rollout_data/1\.pt\[samples\]\[2\]\['weight_versions'\]: "
               + match)


def test_cp_reassembly_by_hand():
    # total 8, response 6, cp 2: chunk 2; rank 0 holds logits [1, 2) and [6, 7) -> response positions 0 and 5,
    # rank 1 holds [2, 4) and [4, 6) -> positions 1..4
    full = assemble_cp({0: np.array([-0.1, -0.6]), 1: np.array([-0.2, -0.3, -0.4, -0.5])}, 8, 6, 2, "x")
    assert np.allclose(full, [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])


def _fails(fmt: str, dump: Path, logdir: Path, match: str, **kw) -> None:
    with pytest.raises(ImportFormatError, match=match):
        import_run(fmt, dump, logdir, run_id="bad", **kw)
    assert not logdir.exists() or list(logdir.iterdir()) == []


def test_truncated_pt_names_the_file(tmp_path):
    write_dump(tmp_path / "dump")
    path = tmp_path / "dump/train_data/1_5.pt"
    path.write_bytes(path.read_bytes()[:300])
    _fails("miles", tmp_path / "dump", tmp_path / "logs", r"train_data/1_5\.pt: not a readable torch file")


def test_missing_cp_rank_file_is_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=1, tp=1, pp=1)
    # ranks of dp 0: cp 0 -> rank 0, cp 1 -> rank 1; drop cp rank 1
    (tmp_path / "dump/train_data/0_1.pt").unlink()
    _fails("miles", tmp_path / "dump", tmp_path / "logs", r"context-parallel rank\(s\) \[1\] of 2 missing")


def test_mixed_writer_versions_are_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=1)
    write_dump(tmp_path / "other", steps=1, kind="slime")
    (tmp_path / "other/train_data/0.pt").rename(tmp_path / "dump/train_data/0.pt")
    _fails("slime", tmp_path / "dump", tmp_path / "logs", r"train_data/0_0\.pt: a per-rank train dump, unlike "
                                                         r".*train_data/0\.pt \(a single-file train dump\): .* mixed")


def test_cp_rank_recorded_in_some_files_only_is_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=1, tp=1, pp=1, cp=1)
    path = tmp_path / "dump/train_data/0_1.pt"
    pack = torch.load(path)
    for key in ("cp_rank", "cp_size", "qkv_format"):
        pack.pop(key)
    torch.save(pack, path)
    _fails("miles", tmp_path / "dump", tmp_path / "logs", r"0_1\.pt: no cp_rank recorded, unlike .*0_0\.pt "
                                                         r"\(cp_rank recorded\): dumps of two writer versions")


def test_unknown_format_version_and_wrong_length(tmp_path):
    write_dump(tmp_path / "dump", steps=1, kind="slime")
    path = tmp_path / "dump/train_data/0.pt"
    pack = torch.load(path)
    pack["format_version"] = 3
    torch.save(pack, path)
    _fails("slime", tmp_path / "dump", tmp_path / "logs", r"0\.pt: format_version 3")
    pack["format_version"] = 2
    pack["samples"][3]["log_probs"] = pack["samples"][3]["log_probs"][:-1]
    torch.save(pack, path)
    _fails("slime", tmp_path / "dump", tmp_path / "logs", r"0\.pt\[samples\]\[3\]: log_probs has \d+ value\(s\)")


def test_step_without_train_dump_is_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=2, tp=1, pp=1)
    for path in (tmp_path / "dump/train_data").glob("1_*.pt"):
        path.unlink()
    _fails("miles", tmp_path / "dump", tmp_path / "logs", r"rollout_data/1\.pt: no train_data for rollout 1")


def test_pickled_objects_need_allow_pickle(tmp_path):
    write_dump(tmp_path / "dump", steps=1, tp=1, pp=1)
    path = tmp_path / "dump/rollout_data/0.pt"
    pack = torch.load(path)
    n = len(pack["samples"][0]["tokens"])
    pack["samples"][0]["rollout_routed_experts"] = np.zeros((n - 1, 2, 2), dtype=np.int32)  # (positions fed, L, k)
    torch.save(pack, path)
    _fails("miles", tmp_path / "dump", tmp_path / "logs", r"0\.pt: holds objects beyond tensors .* allow_pickle")
    assert validate_logdir(import_run("miles", tmp_path / "dump", tmp_path / "logs", allow_pickle=True)) == []


def test_per_rank_dump_without_cp_rank_recovers_the_layout(tmp_path):
    written = write_dump(tmp_path / "dump", record_cp=False)  # TP 2 x CP 2 x DP 2 x PP 2, no cp_rank recorded
    run_dir = import_run("slime", tmp_path / "dump", tmp_path / "logs")
    assert validate_logdir(run_dir) == []
    assert "without cp_rank" in json.loads((run_dir / "run.json").read_text())["source"]["format"]
    _check_values(run_dir, written)


def test_unplaceable_legacy_slices_are_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=1, tp=1, pp=1, record_cp=False)
    path = tmp_path / "dump/train_data/0_1.pt"  # dp 0, cp 1
    pack = torch.load(path)
    pack["rollout_data"]["rollout_log_probs"][0] = pack["rollout_data"]["rollout_log_probs"][0][:-1]
    torch.save(pack, path)
    _fails("slime", tmp_path / "dump", tmp_path / "logs", r"sample_index 0: rollout_log_probs slices of widths "
                                                         r"\[\d+, \d+\] are not the context-parallel zigzag")


def test_train_and_rollout_dumps_that_do_not_pair_are_refused(tmp_path):
    write_dump(tmp_path / "dump", steps=1, kind="slime")
    path = tmp_path / "dump/train_data/0.pt"
    pack = torch.load(path)
    sample = pack["samples"][3]  # its copy of the engine's log-probs no longer matches the rollout dump's
    sample["rollout_log_probs"] = sample["rollout_log_probs"] - 0.5
    torch.save(pack, path)
    _fails("slime", tmp_path / "dump", tmp_path / "logs", r"0\.pt\[samples\]\[3\]: rollout_log_probs\[0\] = .* "
                                                         r"but .*rollout_data/0\.pt\[samples\]\[3\] has .* do not pair")


def routed_dump(dump: Path, layers: int = 3, top_k: int = 2, experts: int = 8, seed: int = 0) -> dict[int, tuple]:
    """A slime dump whose samples carry ``rollout_routed_experts`` as miles writes them: ``(len(tokens) - 1, L, k)``
    int32, row i the experts of position i (here a function of the position, so a row off shows)."""
    rng = np.random.default_rng(seed)
    written = {}
    for rid in range(2):
        samples = make_samples(rng, rid)
        for s in samples:
            i = np.arange(len(s["tokens"]) - 1)[:, None, None]
            s["rollout_routed_experts"] = torch.from_numpy(
                ((i + np.arange(layers)[:, None] * 3 + np.arange(top_k)) % experts).astype(np.int32))
        fields = trainer_fields(rng, samples)
        write_rollout(dump, rid, samples, miles=False)
        write_slime_train(dump, rid, samples, fields)
        written[rid] = (samples, fields)
    return written


def test_routed_experts_become_engine_experts_at_the_predicting_position(tmp_path):
    """Token t of a response gets row t - 1 of rollout_routed_experts (the position whose output predicts it); the
    run declares routing_shape with the expert count unknown to the dump, and carries no trainer side."""
    written = routed_dump(tmp_path / "dump")
    run_dir = import_run("slime", tmp_path / "dump", tmp_path / "logs", run_id="r")
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["routing_shape"] == [3, 2, 32767]
    assert "rollout_routed_experts" in manifest["config"]["import"]["columns"]["engine_experts"]
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    assert tokens["trainer_experts"].isna().all() and tokens["routing_agreement"].isna().all()
    for rid, (samples, _) in written.items():
        for s in samples:
            got = tokens[(tokens.step == rid) & (tokens.sample_id == s["index"])].sort_values("pos")
            prompt = len(s["tokens"]) - s["response_length"]
            want = s["rollout_routed_experts"].numpy()[prompt - 1 + got.pos.to_numpy()]
            assert np.array_equal(np.stack(got.engine_experts.to_list()), want.reshape(len(got), -1))
    assert validate_logdir(tmp_path / "logs") == []
    from trustscope import report_where
    from trustscope.db import connect

    with connect(tmp_path / "logs", cache=False) as db:
        sides = report_where.routing_sides(db)
    assert sides == {"r": (len(tokens), 0)}
    assert f"Run r logs the engine's routed experts alone ({len(tokens):,} token rows)" in \
        report_where.routing_absent_sentence(["r"], sides)


def test_routed_experts_of_a_wrong_shape_or_id_are_refused_naming_the_field(tmp_path):
    from trustscope.importers.slime import read
    from trustscope.importers.writer import write_run

    written = routed_dump(tmp_path / "dump")
    samples = written[0][0]
    bad = samples[2]["rollout_routed_experts"][:-1]  # one row short: not one row per position fed
    samples[2]["rollout_routed_experts"] = bad
    write_rollout(tmp_path / "dump", 0, samples, miles=False)
    n = len(samples[2]["tokens"])
    _fails("slime", tmp_path / "dump", tmp_path / "logs", rf"\[samples\]\[2\]\['rollout_routed_experts'\] has shape "
           rf"\({n - 2}, 3, 2\), expected \({n - 1}, MoE layers, top-k\)")

    written = routed_dump(tmp_path / "dump2")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_experts": 6,
                                                   "num_experts_per_tok": 2}))

    class Vocab(list):
        name_or_path = str(model)

    run = read(tmp_path / "dump2")
    with pytest.raises(ImportFormatError, match=r"engine_experts [67] at response position \d+, MoE layer \d, "
                                                r"slot \d: expert ids are in \[0, 6\)"):
        write_run(run, tmp_path / "logs", "r", vocab=Vocab(str(i) for i in range(V)))
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_experts": 8,
                                                   "num_experts_per_tok": 2}))
    with pytest.raises(ImportFormatError, match=r"routed experts of shape \(tokens, 3, 2\), but the model config "
                                                r".* routes \(tokens, 4, 2\)"):
        write_run(run, tmp_path / "logs", "r", vocab=Vocab(str(i) for i in range(V)))
    assert not (tmp_path / "logs" / "r").exists()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_experts": 8,
                                                   "num_experts_per_tok": 2}))
    run_dir = write_run(run, tmp_path / "logs", "r", vocab=Vocab(str(i) for i in range(V)))
    assert json.loads((run_dir / "run.json").read_text())["routing_shape"] == [3, 2, 8]


def test_a_step_with_unrouted_scored_tokens_logs_no_experts(tmp_path):
    """miles fills rows it has no routing for with -1: a step where a scored token has such a row is logged
    without engine_experts (NULL), named in run.json, the other step keeps them."""
    written = routed_dump(tmp_path / "dump")
    samples = written[1][0]
    prompt = len(samples[0]["tokens"]) - samples[0]["response_length"]
    samples[0]["rollout_routed_experts"][prompt - 1] = -1
    write_rollout(tmp_path / "dump", 1, samples, miles=False)
    run_dir = import_run("slime", tmp_path / "dump", tmp_path / "logs", run_id="r")
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    assert tokens.loc[tokens.step == 0, "engine_experts"].notna().all()
    assert tokens.loc[tokens.step == 1, "engine_experts"].isna().all()
    assert "engine_experts" in json.loads((run_dir / "run.json").read_text())["config"]["import"]["columns"]["nulls"]
