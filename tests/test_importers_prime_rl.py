"""prime-rl token export importer, on files written the way prime-rl's ``TokenExporter`` writes them.

``PrimeRLExporter`` (``bench/prime_rl_export.py``, shared with the importer benchmarks) follows
``src/prime_rl/trainer/rl/token_export.py`` (PrimeIntellect-ai/prime-rl):
packed micro-batches ``(1, L)``, columns through ``tolist()`` with non-finite floats as ``null``, absent tensors as
lists of ``null``, trailing padding (``env_names == ""`` and no loss mask) trimmed, one compact JSON line per
sequence with a loss-mask token, ``STABLE`` touched per finished step. The trainer's log-probs and entropy are
shifted right with prime-rl's pad values (``log(1/V)``, ``log V``) at position 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from bench.prime_rl_export import (
    DPPO_HIGH,
    DPPO_LOW,
    PrimeRLExporter,
    Rollout,
    make_rollouts,
    pack,
)
from trustscope.cli import app
from trustscope.importers import ImportFormatError, import_run
from trustscope.runformat.validation import validate_logdir


def _node(parent: int | None, role: str, text: str, ids: list[int], sampled: bool, mu: list[float]) -> dict:
    """A ``MessageNode`` as ``model_dump(mode="json", exclude_none=True)`` writes it."""
    node = {"message": {"role": role, "content": text}, "sampled": sampled, "timestamp": 1.7e9, "token_ids": ids,
            "mask": [sampled] * len(ids), "is_content": [], "logprobs": mu if sampled else []}
    if parent is not None:
        node["parent"] = parent
    return node


def episode_record(r: Rollout, i: int, step: int, group: str) -> dict:
    """``verifiers.v1.Episode.to_record()`` of one single-agent rollout (a tool turn when ``r.trained`` has one)."""
    c, mu = r.completion, r.mu
    nodes = [_node(None, "user", f"question {group}", r.prompt, False, [])]
    if all(r.trained):
        nodes.append(_node(0, "assistant", f"answer {i}", c, True, mu))
    else:
        nodes += [_node(0, "assistant", f"call {i}", c[:2], True, mu[:2]),
                  _node(1, "tool", f"result {i}", c[2:4], False, []),
                  _node(2, "assistant", f"answer {i}", c[4:], True, mu[4:])]
    task = {"type": "Task", "data": {"question": group}, "key": group, "hash": group}
    trace = {"version": 1, "id": f"t{step}-{i}", "verifiers": {"version": "0.3.1.dev59", "commit": "abc"},
             "task": task, "agent": {"config": {}, "name": "agent", "trainable": True}, "tools": [], "nodes": nodes,
             "calls": [], "request_rewrites": [], "response_rewrites": [],
             "rewards": {"correct": {"score": r.reward, "weight": 1.0}}, "metrics": {}, "info": {},
             "extra_usage": [], "is_completed": True, "ok": True, "stop_condition": "completed", "errors": [],
             "timing": {"start": 1.7e9}}
    return {"id": f"e{step}-{i}", "env": {"id": r.env, "name": r.env}, "task": task, "group": {"id": group},
            "run": {"type": "train", "id": "run", "work": {"type": "train", "step": step}}, "ok": True,
            "errors": [], "traces": [trace]}


def write_traces(out: Path, step: int, rollouts: list[Rollout], tag: str) -> None:
    """Append the episodes to ``rollouts/step_N/train/effective/traces.jsonl`` as ``FileMonitor.log_episodes``
    does (orjson's compact JSON, one episode per line)."""
    path = out / "rollouts" / f"step_{step}" / "train" / "effective" / "traces.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for i, r in enumerate(rollouts):
            group = f"{tag}-{i // 4}"
            f.write(json.dumps(episode_record(r, i, step, group), separators=(",", ":"), ensure_ascii=False) + "\n")


def write_export(out: Path, steps: int = 2, ranks: int = 2, per_rank: int = 8, layout: str = "weight-stream",
                 seed: int = 0, unscored: bool = True, stable: bool = True,
                 traces: bool = False, run_id: str | None = None) -> dict[tuple[int, int], list[Rollout]]:
    """A small multi-step, multi-rank export (with the orchestrator's trace streams and metrics.jsonl when
    ``traces``); returns the rollouts of each (step, rank) for the checks."""
    rng = np.random.default_rng(seed)
    written = {}
    exporters = [PrimeRLExporter(out, r, layout, run_id=run_id) for r in range(ranks)]
    for step in range(steps):
        for rank, exp in enumerate(exporters):
            rollouts = make_rollouts(rng, per_rank)
            if unscored and rank == 0:
                rollouts[0].mu[1] = float("-inf")  # the engine returned -inf: the writer writes null
            half = per_rank // 2
            for micro, part in enumerate((rollouts[:half], rollouts[half:])):
                exp.export(step, micro, *pack(part, pad_to=sum(len(r.prompt) + len(r.completion) for r in part) + 7))
            written[(step, rank)] = rollouts
            if traces:
                write_traces(out, step, rollouts, f"s{step}r{rank}")
        if traces:
            with (out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "time": 1.7e9, "reward/mean": 0.5 + step, "loss": 0.1}) + "\n")
        if stable:
            for exp in exporters:
                exp.mark_stable(step)
    return written


def _tokens(run_dir: Path):
    return pq.read_table(run_dir / "tokens").to_pandas().sort_values(["step", "rank", "sample_id", "pos"])


def test_weight_stream_export_imports_exactly(tmp_path):
    written = write_export(tmp_path / "out")
    run_dir = import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="p", version="0.3.0")
    assert validate_logdir(tmp_path / "logs") == []
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["mu_source"] == "imported"
    assert manifest["source"]["framework"] == "prime-rl" and manifest["source"]["version"] == "0.3.0"
    assert "weight-stream" in manifest["source"]["format"]
    assert manifest["config"]["import"]["unscored_tokens"] == 2  # one per step on rank 0
    tokens = _tokens(run_dir)
    expected_rows = sum(sum(r.trained) for rs in written.values() for r in rs) - 2
    assert len(tokens) == expected_rows
    # rank 0 of step 1, its second rollout: values, positions and the DPPO mask computed here independently
    r = written[(1, 0)][1]
    got = tokens[(tokens.step == 1) & (tokens["rank"] == 0)]
    got = got[got.sample_id == sorted(got.sample_id.unique())[1]]
    keep = np.flatnonzero(r.trained)
    assert got.pos.tolist() == keep.tolist()
    assert np.allclose(got.mu_logprob, np.array(r.mu, np.float32)[keep])
    assert np.allclose(got.pi_logprob, np.array(r.pi, np.float32)[keep])
    assert np.allclose(got.entropy, np.array(r.entropy, np.float32)[keep])
    assert got.old_logprob.isna().all()
    delta = np.exp(np.array(r.pi, np.float32)) - np.exp(np.array(r.mu, np.float32))
    blocked = np.where(r.advantage > 0, delta > DPPO_HIGH, delta < -DPPO_LOW)[keep]
    assert got.kept.tolist() == (~blocked).tolist()
    # the tool turn (environment tokens 2-3, out of the loss mask) starts the model's turn 1 at position 4
    assert not all(r.trained) and got.turn.tolist() == [int(p >= 4) for p in keep]
    assert tokens.turn.max() == 1 and tokens.policy_version.isna().all()  # no weight version in the export
    assert set(tokens["rank"]) == {0, 1}
    samples = pq.read_table(run_dir / "samples").to_pandas()
    assert len(samples) == sum(len(rs) for rs in written.values())
    # four rollouts share a prompt: prompt ids group them
    step0 = samples[samples.step == 0].sort_values("sample_id")
    assert step0.groupby("prompt_id").size().tolist() == [4, 4, 4, 4]


def test_training_mode_layout_carries_the_reward(tmp_path):
    written = write_export(tmp_path / "out", steps=1, layout="training-mode", unscored=False, stable=False)
    run_dir = import_run("prime-rl", tmp_path / "out" / "token_exports", tmp_path / "logs")
    assert validate_logdir(run_dir) == []
    assert "training-mode" in json.loads((run_dir / "run.json").read_text())["source"]["format"]
    samples = pq.read_table(run_dir / "samples").to_pandas().sort_values(["rank", "sample_id"])
    want = [r.reward for rank in (0, 1) for r in written[(0, rank)]]
    assert samples.reward.tolist() == want


def _no_import(logdir: Path) -> None:
    assert not logdir.exists() or list(logdir.iterdir()) == []


def _import_fails(src: Path, logdir: Path, match: str) -> None:
    with pytest.raises(ImportFormatError, match=match):
        import_run("prime-rl", src, logdir, run_id="bad")
    _no_import(logdir)


def test_loss_channel_layout_of_a_named_run_imports_from_the_output_root(tmp_path):
    """prime-rl's loss-channel layout (a per-token ``losses`` field, no ``training_mode``, the run under
    ``<run_id>/token_exports``, steps from 0), pointed at the output root: the same rows as the weight-stream
    export of the same rollouts, the reward from ``rewards``."""
    written = write_export(tmp_path / "out", layout="loss-channel", run_id="tenant-a")
    write_export(tmp_path / "ref", layout="weight-stream")
    run_dir = import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="lc")
    ref_dir = import_run("prime-rl", tmp_path / "ref", tmp_path / "logs", run_id="ws")
    assert validate_logdir(tmp_path / "logs") == []
    assert "loss-channel" in json.loads((run_dir / "run.json").read_text())["source"]["format"]
    tokens, ref = _tokens(run_dir), _tokens(ref_dir)
    assert len(tokens) == sum(sum(r.trained) for rs in written.values() for r in rs) - 2
    cols = ["step", "rank", "sample_id", "pos", "token_id", "mu_logprob", "pi_logprob", "advantage", "kept"]
    assert tokens[cols].reset_index(drop=True).equals(ref[cols].reset_index(drop=True))
    samples = pq.read_table(run_dir / "samples").to_pandas()
    assert samples["reward"].notna().all() and sorted(set(samples["step"])) == [0, 1]


def test_fields_trustscope_does_not_know_are_kept_as_columns_and_named_once(tmp_path):
    """Per-token lists become typed columns of the run (cut to the rows like the known ones), per-sequence
    scalars are broadcast over the sequence's rows; a field no column takes is named with why and left out."""
    write_export(tmp_path / "out", steps=2)
    for path in (tmp_path / "out/token_exports").glob("step_*/rank_*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "teacher_logprobs": r["trainer_logprobs"], "turn": 1,
                                            "difficulty": 0.25 * r["micro_sequence_idx"], "judge": "ok",
                                            "meta": {"seed": 1}}) + "\n" for r in records))
    with pytest.warns(ImportWarning, match=r"fields trustscope does not know \(first at .*step_0/rank_0\.jsonl:1\): "
                                           r"kept as the run's own columns: difficulty \(float64\), judge \(string\), "
                                           r"teacher_logprobs \(float64\); left out: meta \(a dict\); turn "
                                           r"\(trustscope has a column of that name\)") as caught:
        run_dir = import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="x")
    assert len([w for w in caught if issubclass(w.category, ImportWarning)]) == 1
    assert validate_logdir(tmp_path / "logs") == []
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["logging"]["extra_columns"] == {"difficulty": "float64", "judge": "string",
                                                    "teacher_logprobs": "float64"}
    tokens = _tokens(run_dir)
    assert len(tokens) > 0 and tokens["judge"].eq("ok").all()
    np.testing.assert_allclose(tokens["teacher_logprobs"], tokens["pi_logprob"], atol=1e-6)
    assert tokens.groupby(["step", "rank", "sample_id"])["difficulty"].nunique().eq(1).all()
    assert set(tokens["difficulty"]) > {0.0}
    assert (tokens["turn"] != 1).any()  # the built-in column keeps its own values


def test_steps_read_on_worker_processes_write_the_run_one_process_writes(tmp_path):
    """Read step by step on two worker processes or in the importing process: the same rows, samples, steps
    and description of the whole source in run.json."""
    write_export(tmp_path / "run", steps=3, traces=True)
    one = import_run("prime-rl", tmp_path / "run", tmp_path / "logs", run_id="one", workers=1)
    two = import_run("prime-rl", tmp_path / "run", tmp_path / "logs", run_id="two", workers=2)
    assert validate_logdir(tmp_path / "logs") == []
    assert _tokens(one).drop(columns="run_id").reset_index(drop=True).equals(
        _tokens(two).drop(columns="run_id").reset_index(drop=True))
    for table in ("samples", "steps"):
        a, b = (pq.read_table(d / table).to_pandas().drop(columns="run_id") for d in (one, two))
        assert len(a) > 0 and a.sort_values(list(a.columns[:3])).reset_index(drop=True).equals(
            b.sort_values(list(b.columns[:3])).reset_index(drop=True))
    m1, m2 = (json.loads((d / "run.json").read_text()) for d in (one, two))
    assert m1["config"] == m2["config"] and m1["config"]["import"]["sequences"] == 3 * 2 * 8
    assert "48 of 48 sequences matched" in m1["config"]["import"]["columns"]["samples"]


def test_truncated_file_names_file_and_line(tmp_path):
    write_export(tmp_path / "out", steps=2)
    path = tmp_path / "out/token_exports/step_1/rank_1.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    n = data[: len(data) - 40].count(b"\n") + 1
    _import_fails(tmp_path / "out", tmp_path / "logs", rf"step_1/rank_1\.jsonl:{n}: .*truncated")


def test_mixed_versions_are_refused(tmp_path):
    write_export(tmp_path / "out", steps=1, layout="weight-stream")
    write_export(tmp_path / "old", steps=2, layout="training-mode")
    (tmp_path / "old/token_exports/step_1").rename(tmp_path / "out/token_exports/step_1")
    _import_fails(tmp_path / "out", tmp_path / "logs", r"step_1/rank_0\.jsonl:1: training-mode layout, unlike .* "
                                                       r"\(weight-stream layout\): exports of two prime-rl versions "
                                                       r"are mixed")


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.pop("trainer_logprobs"), r"missing \['trainer_logprobs'\]"),
    (lambda r: r.update(schema_version=2), r"schema_version 2"),
    (lambda r: r.update(entropy=r["entropy"][:-1]), r"'entropy' has length"),
    (lambda r: r.update(step=7), r"record says step 7"),
    (lambda r: r.update(inference_logprobs=[0.5] * len(r["token_ids"])), r"mu_logprob 0.5 .* a log-probability"),
    (lambda r: r.update(entropy=[-1.0] * len(r["token_ids"])), r"entropy -1.0 .* an entropy is >= 0"),
    (lambda r: r.update(token_ids=[-3] * len(r["token_ids"])), r"token_id -3 at response position 0"),
    (lambda r: r.update(token_ids=["a"] * len(r["token_ids"])), r"'token_ids' must be a list of integers"),
])
def test_wrong_record_names_file_and_line(tmp_path, edit, match):
    write_export(tmp_path / "out", steps=1)
    path = tmp_path / "out/token_exports/step_0/rank_1.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[2])
    edit(record)
    lines[2] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    _import_fails(tmp_path / "out", tmp_path / "logs", rf"rank_1\.jsonl:3: .*{match}")


def test_unfinished_step_is_refused(tmp_path):
    write_export(tmp_path / "out", steps=2)
    (tmp_path / "out/token_exports/step_1/STABLE").unlink()
    _import_fails(tmp_path / "out", tmp_path / "logs", r"step_1: no STABLE marker")


def test_existing_run_is_not_touched(tmp_path):
    write_export(tmp_path / "out", steps=1)
    import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="p")
    before = sorted(p.name for p in (tmp_path / "logs/p/tokens").iterdir())
    with pytest.raises(FileExistsError):
        import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="p")
    assert sorted(p.name for p in (tmp_path / "logs/p/tokens").iterdir()) == before
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["p"]


def test_import_syncs_each_file_once_before_the_run_appears(tmp_path, monkeypatch):
    from trustscope.runformat import fsops

    synced: list[tuple[Path, bool]] = []  # (path, whether the run was in place then)
    monkeypatch.setattr(fsops, "fsync_file",
                        lambda path: synced.append((Path(path), (tmp_path / "logs" / "p").exists())))
    write_export(tmp_path / "out", steps=2)
    run_dir = import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="p")
    assert synced[-1] == (tmp_path / "logs", True)  # the rename, after it
    before = synced[:-1]
    assert before and not any(in_place for _, in_place in before)
    tmp_root = before[0][0].parents[len(before[0][0].relative_to(tmp_path / "logs").parts) - 2]
    assert tmp_root.name.startswith(".import-p-")
    got = sorted(str(path.relative_to(tmp_root / "p")) for path, _ in before)
    want = sorted(str(path.relative_to(run_dir)) for path in [run_dir, *run_dir.rglob("*")])
    assert got == want  # every file and folder of the run, once; none while the loggers wrote


def test_trace_streams_and_metrics_fill_samples_and_steps(tmp_path):
    written = write_export(tmp_path / "run", traces=True)
    run_dir = import_run("prime-rl", tmp_path / "run", tmp_path / "logs", run_id="p")
    assert validate_logdir(run_dir) == []
    manifest = json.loads((run_dir / "run.json").read_text())
    assert "verifiers 0.3.1.dev59" in manifest["source"]["format"]
    assert "32 of 32 sequences matched" in manifest["config"]["import"]["columns"]["samples"]
    samples = pq.read_table(run_dir / "samples").to_pandas().sort_values(["step", "rank", "sample_id"])
    r = written[(1, 1)][5]
    row = samples[(samples.step == 1) & (samples["rank"] == 1)].iloc[5]
    assert row.reward == r.reward and row.prompt == "question s1r1-1" and row.finish_reason == "completed"
    assert row.response == ("answer 5" if all(r.trained) else "call 5\nanswer 5")
    assert (samples.groupby(["step", "prompt_id"]).size() == 4).all()
    steps = pq.read_table(run_dir / "steps").to_pandas()
    got = sorted(zip(steps.step, steps.name, steps.value, strict=True))
    assert got == [(0, "loss", 0.1), (0, "reward/mean", 0.5), (1, "loss", 0.1), (1, "reward/mean", 1.5)]


def test_trace_streams_of_two_versions_are_refused(tmp_path):
    write_export(tmp_path / "run", steps=1, traces=True)
    path = tmp_path / "run/rollouts/step_0/train/effective/traces.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[3])
    record["traces"][0]["verifiers"]["version"] = "0.2.0"
    lines[3] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    _import_fails(tmp_path / "run", tmp_path / "logs", r"traces\.jsonl:4: written by verifiers 0\.2\.0, unlike "
                                                       r".*traces\.jsonl:1 \(written by verifiers 0\.3\.1\.dev59\): "
                                                       r"trace streams of two verifiers versions are mixed")


def test_token_fraction_writes_a_sample_with_exact_summaries(tmp_path):
    """``--token-fraction`` keeps the token rows of a share of sequences (the logger's hash), and the summaries
    table counts every token as a full import's rows do."""
    write_export(tmp_path / "out", steps=2, per_rank=16)
    full = import_run("prime-rl", tmp_path / "out", tmp_path / "logs", run_id="full")
    result = CliRunner().invoke(app, ["import", "prime-rl", str(tmp_path / "out"), str(tmp_path / "logs"),
                                      "--run-id", "part", "--token-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    part = tmp_path / "logs" / "part"
    assert validate_logdir(tmp_path / "logs") == []
    all_rows, kept = _tokens(full), _tokens(part)
    assert 0 < len(kept) < len(all_rows) / 2
    assert json.loads((part / "run.json").read_text())["logging"]["token_fraction"] == 0.25
    summaries = pq.read_table(part / "summaries").to_pandas()
    total = summaries[(summaries["metric"] == "tokens") & summaries["dimension"].isna()].groupby("step")["count"].sum()
    assert total.to_dict() == all_rows.groupby("step").size().to_dict()
    assert len(pq.read_table(part / "samples")) == len(pq.read_table(full / "samples"))
