"""TokenLogger: round trips (padded, ragged, torch), sampling options, resume, ranks, bad input, NullLogger."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from trustscope import runformat as S
from trustscope.logger import LogDirError, LogWarning, NullLogger, SchemaError, TokenLogger, run_status

B, T, K, V = 4, 6, 3, 50


def make_step(seed=0, b=B, t=T, k=K):
    """A padded step: dicts for log_step plus the mask. Rows 1 and 3 are shorter (padding)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, t), dtype=bool)
    mask[1, t - 2:] = False
    mask[3, 1:] = False
    mu_topk = -np.sort(rng.random((b, t, k)).astype(np.float32) * 4, axis=-1)  # (B, T, K) descending
    ids = np.stack([rng.permutation(V)[:k] for _ in range(b * t)]).reshape(b, t, k)  # (B, T, K)
    tokens = {
        "token_id": ids[..., 0],
        "mu_logprob": mu_topk[..., 0],
        "pi_logprob": mu_topk[..., 0] - 0.01,
        "old_logprob": mu_topk[..., 0] - 0.005,
        "entropy": rng.random((b, t)).astype(np.float32),
        "advantage": rng.normal(size=b).astype(np.float32),  # (B,) broadcast over T
        "mu_topk_ids": ids,
        "mu_topk_logprobs": mu_topk,
        "pi_topk_logprobs": mu_topk - 0.01,
        "kept": rng.random((b, t)) > 0.2,
    }
    samples = {
        "sample_id": np.arange(b) + 100,
        "prompt_id": np.arange(b) // 2,
        "prompt": [f"prompt {i}" for i in range(b)],
        "response": [f"response {i}" for i in range(b)],
        "reward": rng.random(b),
        "advantage": tokens["advantage"],
        "finish_reason": ["stop"] * b,
    }
    return tokens, mask, samples


def read(run_dir, table):
    return ds.dataset(run_dir / table, format="parquet").to_table().sort_by(
        [(c, "ascending") for c in S.KEYS[table] if c != "run_id"]
    )


def test_padded_round_trip(tmp_path):
    tokens, mask, samples = make_step()
    with TokenLogger(tmp_path, "run-a", config={"lr": 1e-6}, model={"name": "tiny"}, sampling={"topk": K},
                     tokenizer="char", vocab=[f"t{i}" for i in range(V)], loss_rule="dppo_binary_tv") as lg:
        lg.log_step(3, tokens=tokens, mask=mask, samples=samples, scalars={"loss": 0.25, "lr": 1e-6})
    run = tmp_path / "run-a"
    got = read(run, "tokens")
    assert got.schema.remove_metadata().equals(S.TOKENS)
    assert got.num_rows == mask.sum()
    b, t = np.nonzero(mask)
    np.testing.assert_array_equal(got["sample_id"].to_numpy(), samples["sample_id"][b])
    np.testing.assert_array_equal(got["pos"].to_numpy(), t)
    np.testing.assert_array_equal(got["token_id"].to_numpy(), tokens["token_id"][b, t])
    np.testing.assert_array_equal(got["mu_logprob"].to_numpy(), tokens["mu_logprob"][b, t])
    np.testing.assert_array_equal(got["advantage"].to_numpy(), tokens["advantage"][b])
    np.testing.assert_array_equal(got["kept"].to_numpy(), tokens["kept"][b, t])
    topk = np.stack(got["pi_topk_logprobs"].to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(topk, tokens["pi_topk_logprobs"][b, t])
    assert set(got["loss_rule"].to_pylist()) == {"dppo_binary_tv"}
    assert set(got["step"].to_pylist()) == {3} and set(got["run_id"].to_pylist()) == {"run-a"}

    import torch

    from trustscope import divergence

    # computed in float64, stored in float32
    mu = torch.from_numpy(tokens["mu_topk_logprobs"][b, t]).double()
    pi = torch.from_numpy(tokens["pi_topk_logprobs"][b, t]).double()
    np.testing.assert_allclose(got["topk_tv"].to_numpy(), divergence.topk_tv(mu, pi).float().numpy(), rtol=1e-6)
    np.testing.assert_allclose(got["topk_kl"].to_numpy(), divergence.topk_kl(mu, pi).float().numpy(), rtol=1e-6)

    smp = read(run, "samples")
    assert smp["length"].to_pylist() == mask.sum(1).tolist()
    assert smp["prompt"].to_pylist() == samples["prompt"]
    steps = read(run, "steps")
    assert dict(zip(steps["name"].to_pylist(), steps["value"].to_pylist(), strict=True)) == {"loss": 0.25, "lr": 1e-6}
    vocab = pq.read_table(run / S.VOCAB_FILE)
    assert vocab["text"].to_pylist()[7] == "t7"

    manifest = json.loads((run / S.MANIFEST).read_text())
    assert manifest["schema_version"] == S.SCHEMA_VERSION
    assert manifest["status"] == "finished" and run_status(run) == "finished"
    assert manifest["config"] == {"lr": 1e-6} and manifest["model"] == {"name": "tiny"}
    assert manifest["sampling"] == {"topk": K} and manifest["tokenizer"] == "char"
    assert manifest["logging"]["topk_k"] == K and manifest["rows"]["tokens"] == mask.sum()
    assert S.validate_logdir(tmp_path) == []


def test_ragged_equals_padded(tmp_path):
    tokens, mask, samples = make_step(1)
    lengths = mask.sum(1)
    ragged = {}
    for name, value in tokens.items():
        if name == "advantage":
            ragged[name] = value
        else:
            ragged[name] = [value[i, : lengths[i]] for i in range(B)]
    with TokenLogger(tmp_path, "padded") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    with TokenLogger(tmp_path, "ragged") as lg:
        lg.log_step(0, tokens=ragged, samples=samples)
    a, b = read(tmp_path / "padded", "tokens"), read(tmp_path / "ragged", "tokens")
    assert a.drop(["run_id"]).equals(b.drop(["run_id"]))


def test_ragged_with_a_mask_equals_padded(tmp_path):
    """A ragged call with a mask per response: the masked-out positions are no rows and ``pos`` keeps the index."""
    tokens, mask, samples = make_step(1)
    mask = mask.copy()
    mask[:, 1] = False  # a gap inside every response
    ends = [int(np.flatnonzero(row)[-1]) + 1 for row in mask]
    ragged = {name: value if name == "advantage" else [value[i, : ends[i]] for i in range(B)]
              for name, value in tokens.items()}
    with TokenLogger(tmp_path, "padded") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    with TokenLogger(tmp_path, "ragged") as lg:
        lg.log_step(0, tokens=ragged, mask=[mask[i, : ends[i]] for i in range(B)], samples=samples)
    a, b = read(tmp_path / "padded", "tokens"), read(tmp_path / "ragged", "tokens")
    assert a.drop(["run_id"]).equals(b.drop(["run_id"])) and 1 not in b["pos"].to_pylist()


def test_torch_tensors_and_defaults(tmp_path):
    torch = pytest.importorskip("torch")
    tokens, mask, _ = make_step(2)
    t_tokens = {name: torch.from_numpy(np.asarray(v)) for name, v in tokens.items() if name != "pi_topk_logprobs"}
    t_tokens["pi_logprob"] = t_tokens["pi_logprob"].to(torch.bfloat16).requires_grad_(True)
    t_tokens["prompt_id"] = torch.zeros(B, dtype=torch.long)
    with TokenLogger(tmp_path, "torch") as lg:
        lg.log_step(0, tokens=t_tokens, mask=torch.from_numpy(mask), scalars={"loss": torch.tensor(1.5)})
    got = read(tmp_path / "torch", "tokens")
    assert got["sample_id"].to_pylist()[0] == 0  # default arange(B)
    assert got["pi_topk_logprobs"].null_count == got.num_rows  # not given: null
    assert got["topk_tv"].null_count == got.num_rows  # needs both lists
    b, t = np.nonzero(mask)
    expected = torch.from_numpy(tokens["pi_logprob"]).to(torch.bfloat16).float().numpy()[b, t]
    np.testing.assert_array_equal(got["pi_logprob"].to_numpy(), expected)
    assert read(tmp_path / "torch", "steps")["value"].to_pylist() == [1.5]


def test_token_fraction_and_topk_options(tmp_path):
    b = 64
    tokens, mask, samples = make_step(3, b=b)
    kw = {"token_fraction": 0.25, "log_topk": False, "seed": 7}
    for run_id in ("frac-a", "frac-b"):
        with TokenLogger(tmp_path, run_id, **kw) as lg:
            lg.log_step(5, tokens=tokens, mask=mask, samples=samples)
    a, c = read(tmp_path / "frac-a", "tokens"), read(tmp_path / "frac-b", "tokens")
    kept = set(a["sample_id"].to_pylist())
    assert kept == set(c["sample_id"].to_pylist())  # deterministic: every rank agrees
    assert 4 <= len(kept) <= 32
    lengths = dict(zip(samples["sample_id"].tolist(), mask.sum(1).tolist(), strict=True))
    assert a.num_rows == sum(lengths[s] for s in kept)  # whole sequences
    assert read(tmp_path / "frac-a", "samples").num_rows == b  # samples always in full
    assert a["mu_topk_ids"].null_count == a.num_rows and a["topk_tv"].null_count == 0
    logging_info = json.loads((tmp_path / "frac-a" / S.MANIFEST).read_text())["logging"]
    assert logging_info["token_fraction"] == 0.25 and logging_info["log_topk"] is False

    with TokenLogger(tmp_path, "half", topk_precision="float16") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    got = read(tmp_path / "half", "tokens")
    flat = np.concatenate(got["mu_topk_logprobs"].to_numpy(zero_copy_only=False))
    assert not (flat.view(np.uint32) & np.uint32((1 << 13) - 1)).any()  # float16's 10 mantissa bits kept
    b_, t_ = np.nonzero(mask)
    np.testing.assert_allclose(flat.reshape(-1, K), tokens["mu_topk_logprobs"][b_, t_], rtol=1e-3)


def test_micro_batches_of_one_step_and_flush_visibility(tmp_path):
    tokens, mask, samples = make_step(4)
    lg = TokenLogger(tmp_path, "micro", flush_seconds=3600)
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    other = dict(samples, sample_id=samples["sample_id"] + 50)
    lg.log_step(0, tokens=tokens, mask=mask, samples=other)
    with pytest.raises(SchemaError, match="sample_id 100 was already logged at step 0"):
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    tables = [tmp_path / "micro" / t for t in S.TABLES]
    assert not [p for d in tables for p in d.rglob("*.parquet")]  # nothing visible before a flush
    lg.flush()
    assert read(tmp_path / "micro", "tokens").num_rows == 2 * mask.sum()
    assert json.loads((tmp_path / "micro" / S.MANIFEST).read_text())["status"] == "running"
    lg.close()
    lg.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        lg.log_step(1, tokens=tokens, mask=mask)


def test_a_closed_run_names_no_files_being_put_in_place(tmp_path):
    """Each commit records its flush's files in ``publishing`` before renaming them; once the writer has ended
    they are all in place, so the manifest of a closed rank keeps none (it used to keep the last flush's)."""
    tokens, mask, samples = make_step(5)
    lg = TokenLogger(tmp_path, "landed", flush_seconds=3600)
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    lg.flush()
    live = json.loads((tmp_path / "landed" / S.MANIFEST).read_text())
    assert live["publishing"] and all((tmp_path / "landed" / final).exists() for _, final, _ in live["publishing"])
    lg.log_step(1, tokens=tokens, mask=mask, samples=samples)
    lg.close()
    manifest = json.loads((tmp_path / "landed" / S.MANIFEST).read_text())
    assert manifest["status"] == "finished" and manifest["publishing"] == []
    assert read(tmp_path / "landed", "tokens").num_rows == 2 * mask.sum()


def test_a_closed_run_keeps_a_committed_file_that_never_landed(tmp_path):
    """An entry of ``publishing`` whose final file is not in place (a writer that died between commit and rename)
    survives close, so the next writer's recovery rolls it forward or counts its rows as lost."""
    tokens, mask, samples = make_step(5)
    lg = TokenLogger(tmp_path, "unlanded", flush_seconds=3600)
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    lg.flush()
    stray = ["tokens/never.parquet.tmp", "tokens/never.parquet", 3]
    lg._files.manifest["publishing"] = [*lg._files.manifest["publishing"], stray]
    lg.close()
    manifest = json.loads((tmp_path / "unlanded" / S.MANIFEST).read_text())
    assert manifest["status"] == "finished" and manifest["publishing"] == [stray]


def test_resume_appends_and_steps_go_forward(tmp_path):
    tokens, mask, samples = make_step(5)
    with TokenLogger(tmp_path, "res", config={"a": 1}) as lg:
        for step in range(3):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
    before = {p: p.read_bytes() for p in (tmp_path / "res").rglob("*.parquet")}
    with pytest.raises(LogDirError, match=r"already exists.*resume=True"):
        TokenLogger(tmp_path, "res")
    lg = TokenLogger(tmp_path, "res", resume=True, config={"a": 2})
    with pytest.raises(SchemaError, match="step 2 is not after step 2"):
        lg.log_step(2, tokens=tokens, mask=mask, samples=samples)
    lg.log_step(3, tokens=tokens, mask=mask, samples=samples)
    lg.close()
    for path, data in before.items():
        assert path.read_bytes() == data  # nothing overwritten
    got = read(tmp_path / "res", "tokens")
    assert sorted(set(got["step"].to_pylist())) == [0, 1, 2, 3]
    manifest = json.loads((tmp_path / "res" / S.MANIFEST).read_text())
    assert manifest["status"] == "finished" and manifest["config"] == {"a": 1}
    assert len(manifest["resumes"]) == 1 and manifest["resumes"][0]["config"] == {"a": 2}
    assert manifest["resumes"][0]["last_step_on_disk"] == 2
    assert S.validate_logdir(tmp_path) == []


def test_ranks_write_their_own_files(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    errors = []

    def work(rank):
        try:
            tokens, mask, samples = make_step(rank)
            ids = dict(samples, sample_id=samples["sample_id"] + 1000 * rank)
            with TokenLogger(tmp_path, "multi", rank=None if rank == 1 else rank) as lg:
                assert lg.rank == rank
                for step in range(3):
                    lg.log_step(step, tokens=tokens, mask=mask, samples=ids)
                    lg.flush()
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    run = tmp_path / "multi"
    got = read(run, "tokens")
    assert sorted(set(got["rank"].to_pylist())) == [0, 1, 2]
    names = [p.name for p in (run / "tokens").rglob("*.parquet")]
    assert len(names) == 9 and all(n.startswith(("r0000-", "r0001-", "r0002-")) for n in names)
    assert sorted(p.name for p in (run / S.RANKS_DIR).iterdir()) == ["rank0001.json", "rank0002.json"]
    assert run_status(run) == "finished"
    assert S.validate_logdir(tmp_path) == []


def test_status_of_dead_and_crashed_writers(tmp_path):
    tokens, mask, samples = make_step(6)
    with pytest.raises(ZeroDivisionError), TokenLogger(tmp_path, "boom") as lg:
        lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
        raise ZeroDivisionError
    manifest = json.loads((tmp_path / "boom" / S.MANIFEST).read_text())
    assert manifest["status"] == "crashed" and "ZeroDivisionError" in manifest["error"]
    assert read(tmp_path / "boom", "tokens").num_rows == mask.sum()  # the buffer was still flushed

    with TokenLogger(tmp_path, "dead") as lg:
        pass
    path = tmp_path / "dead" / S.MANIFEST
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "status": "running", "pid": int(dead.stdout)}))
    assert run_status(tmp_path / "dead") == "crashed"
    path.write_text(json.dumps({**manifest, "status": "running", "pid": os.getpid()}))
    assert run_status(tmp_path / "dead") == "running"


def test_null_logger_has_the_same_methods():
    for name in ("log_step", "flush", "close", "__enter__", "__exit__"):
        real, null = getattr(TokenLogger, name), getattr(NullLogger, name)
        if name != "__exit__":
            assert inspect.signature(real).parameters == inspect.signature(null).parameters, name
    with NullLogger("anything", run_id="x") as lg:
        tokens, mask, _ = make_step()
        lg.log_step(0, tokens=tokens, mask=mask, scalars={"a": 1.0})
        lg.flush()
    assert lg.manifest == {}


# ---------------------------------------------------------------------------------------------------- bad input


def logged_then(tmp_path, bad, *, strict=True, **overrides):
    """Log a good step 0, then call ``bad(logger)``; returns (logger, error or None)."""
    tokens, mask, samples = make_step(7)
    lg = TokenLogger(tmp_path, "bad", strict=strict, **overrides)
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    lg.flush()
    err = None
    try:
        bad(lg, tokens, mask, samples)
    except SchemaError as e:
        err = e
    lg.close()
    good = read(tmp_path / "bad", "tokens").filter(ds.field("step") == 0)
    assert good.num_rows == mask.sum()  # what was written before is intact
    assert S.validate_logdir(tmp_path) == []
    return lg, err


def with_value(tokens, name, value, where=(0, 1)):
    out = {k: np.array(v, copy=True) for k, v in tokens.items()}
    out[name][where] = value
    return out


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("mu_logprob", np.nan, r"tokens\['mu_logprob'\] must be finite, got nan at sample_id 100, pos 1"),
        ("pi_logprob", np.inf, r"tokens\['pi_logprob'\] must be finite, got inf"),
        ("old_logprob", -np.inf, r"tokens\['old_logprob'\] must be finite, got -inf"),
        ("mu_logprob", 0.5, r"tokens\['mu_logprob'\] must be a log-probability .*got 0.5 at sample_id 100, pos 1"),
        ("pi_topk_logprobs", 0.25, r"tokens\['pi_topk_logprobs'\] must be a log-probability .*got 0.25"),
        ("mu_topk_logprobs", np.nan, r"tokens\['mu_topk_logprobs'\] must be finite, got nan"),
        ("token_id", -3, r"tokens\['token_id'\] must be in \[0, .*got -3"),
        ("entropy", -1.0, r"tokens\['entropy'\] must be finite and in .*got -1.0"),
        ("advantage", np.nan, r"tokens\['advantage'\] must be finite, got nan"),
    ],
)
def test_bad_values_raise_naming_field_and_value(tmp_path, name, value, match):
    def bad(lg, tokens, mask, samples):
        where = (0,) if name == "advantage" else (0, 1)
        lg.log_step(1, tokens=with_value(tokens, name, value, where), mask=mask, samples=samples)

    _, err = logged_then(tmp_path, bad)
    assert err is not None and __import__("re").search(match, str(err)), str(err)


def test_bad_rows_dropped_with_a_warning_when_not_strict(tmp_path):
    def bad(lg, tokens, mask, samples):
        with pytest.warns(LogWarning, match=r"dropped 2 token row\(s\).*mu_logprob.*must be finite"):
            bad_tokens = with_value(with_value(tokens, "mu_logprob", np.nan, (0, 1)), "pi_logprob", 0.5, (2, 3))
            lg.log_step(1, tokens=bad_tokens, mask=mask, samples=samples)
        with pytest.warns(LogWarning, match="step 0 not logged: step 0 goes backwards"):
            lg.log_step(0, tokens=tokens, mask=mask, samples=samples)

    _, err = logged_then(tmp_path, bad, strict=False)
    assert err is None
    step1 = read(tmp_path / "bad", "tokens").filter(ds.field("step") == 1)
    _, mask, _ = make_step(7)
    assert step1.num_rows == mask.sum() - 2
    assert json.loads((tmp_path / "bad" / S.MANIFEST).read_text())["dropped_rows"] == 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t, m, s: ({**t, "pi_topk_logprobs": t["pi_topk_logprobs"][..., :2]}, m, s),
         r"tokens\['pi_topk_logprobs'\] has K = 2, but tokens\['mu_topk_ids'\] has K = 3"),
        (lambda t, m, s: ({**t, "mu_topk_ids": t["mu_topk_ids"][..., :2], "mu_topk_logprobs":
                           t["mu_topk_logprobs"][..., :2], "pi_topk_logprobs": t["pi_topk_logprobs"][..., :2]}, m, s),
         r"has K = 2, but this run logs K = 3"),
        (lambda t, m, s: (t, m, {**s, "length": m.sum(1) + 1}),
         r"samples\['length'\] is 7 at sample_id 100, but the mask .* gives length 6"),
        (lambda t, m, s: (t, m[:, :-1], s), r"mask has shape \(4, 5\), tokens\['token_id'\] has \(4, 6\)"),
        (lambda t, m, s: ({**t, "mu_logprob": t["mu_logprob"][:, :-1]}, m, s),
         r"tokens\['mu_logprob'\] must have shape \(B, T\) = \(4, 6\), got \(4, 5\)"),
        (lambda t, m, s: ({**t, "logits": t["mu_logprob"]}, m, s), r"unknown column\(s\) \['logits'\] in tokens"),
        (lambda t, m, s: (t, m, {**s, "score": s["reward"]}), r"unknown column\(s\) \['score'\] in samples"),
        (lambda t, m, s: (t, m, {**s, "sample_id": np.zeros(B, int)}), r"sample_id 0 appears twice"),
        (lambda t, m, s: (t, m, {**s, "reward": np.full(B, np.nan)}), r"samples\['reward'\] must be finite, got nan"),
        (lambda t, m, s: (t, m, {k: v for k, v in s.items() if k != "prompt_id"}), r"prompt_id is required"),
    ],
)
def test_bad_structure_raises(tmp_path, change, match):
    def bad(lg, tokens, mask, samples):
        t, m, s = change(tokens, mask, samples)
        lg.log_step(1, tokens=t, mask=m, samples=s)

    _, err = logged_then(tmp_path, bad)
    assert err is not None and __import__("re").search(match, str(err)), str(err)


def test_ragged_lengths_that_disagree(tmp_path):
    def bad(lg, tokens, mask, samples):
        ragged = {"token_id": [np.arange(3), np.arange(2)], "mu_logprob": [np.zeros(3), np.zeros(3)],
                  "pi_logprob": [np.zeros(3), np.zeros(2)], "advantage": np.zeros(2), "prompt_id": np.zeros(2)}
        lg.log_step(1, tokens=ragged)

    _, err = logged_then(tmp_path, bad)
    assert "tokens['mu_logprob'][1] has shape (3,), but tokens['token_id'][1] has length 2" in str(err)

    def bad_mask(lg, tokens, mask, samples):
        ragged = {"token_id": [np.arange(3), np.arange(2)], "mu_logprob": [np.zeros(3), np.zeros(2)],
                  "pi_logprob": [np.zeros(3), np.zeros(2)], "advantage": np.zeros(2), "prompt_id": np.zeros(2)}
        lg.log_step(1, tokens=ragged, mask=[np.ones(3, bool), np.ones(3, bool)])

    _, err = logged_then(tmp_path / "mask", bad_mask)
    assert "mask[1] has shape (3,), but tokens['token_id'][1] has length 2" in str(err)


def test_step_going_backwards(tmp_path):
    def bad(lg, tokens, mask, samples):
        lg.log_step(4, tokens=tokens, mask=mask, samples=samples)
        lg.log_step(3, tokens=tokens, mask=mask, samples=samples)

    _, err = logged_then(tmp_path, bad)
    assert "step 3 goes backwards: step 4 was already logged" in str(err)


def test_unwritable_log_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LogDirError, match=f"log directory '{blocker}/logs' cannot be written"):
        TokenLogger(blocker / "logs", "x")


def test_write_error_in_background_is_raised_and_keeps_old_files(tmp_path, monkeypatch):
    tokens, mask, samples = make_step(8)
    lg = TokenLogger(tmp_path, "disk")
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    lg.flush()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "ParquetWriter", full)
    lg.log_step(1, tokens=tokens, mask=mask, samples=samples)
    with pytest.raises(LogDirError, match="No space left on device"):
        lg.flush()
    monkeypatch.undo()
    lg.log_step(2, tokens=tokens, mask=mask, samples=samples)
    lg.close()
    got = read(tmp_path / "disk", "tokens")
    assert sorted(set(got["step"].to_pylist())) == [0, 2]
    assert not list((tmp_path / "disk").rglob(f"*{S.TMP_SUFFIX}"))


def test_write_error_is_a_warning_when_not_strict(tmp_path, monkeypatch):
    tokens, mask, samples = make_step(9)
    lg = TokenLogger(tmp_path, "disk2", strict=False)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "ParquetWriter", full)
    lg.log_step(0, tokens=tokens, mask=mask, samples=samples)
    with pytest.warns(LogWarning, match="No space left"):
        lg.flush()
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lg.close()


def test_scalars_only_and_timed_flush(tmp_path):
    lg = TokenLogger(tmp_path, "timed", flush_seconds=0.2)
    lg.log_step(0, scalars={"reward/mean": 0.5, "loss": float("nan")})
    for _ in range(100):  # the writer flushes on its own after flush_seconds
        if list((tmp_path / "timed" / "steps").rglob("*.parquet")):
            break
        threading.Event().wait(0.05)
    steps = read(tmp_path / "timed", "steps")
    assert steps["name"].to_pylist() == ["loss", "reward/mean"]
    assert np.isnan(steps["value"].to_pylist()[0])  # a NaN loss is kept: it is news
    lg.close()


def test_round_mantissa_matches_float16_precision():
    from trustscope.logger import round_mantissa

    x = -np.random.default_rng(0).exponential(3.0, 100_000).astype(np.float32)
    r = round_mantissa(x, 10)
    assert np.abs(r - x).max() <= np.abs(x).max() * 2.0**-11
    half = x.astype(np.float16).astype(np.float32)
    assert (r == half).mean() > 0.999  # equal but for ties (half away from zero vs half to even)
    special = np.array([0.0, -np.inf, np.nan], dtype=np.float32)
    np.testing.assert_array_equal(round_mantissa(special, 10), special)


def test_unreadable_values_are_dropped_with_a_warning_when_not_strict(tmp_path):
    tokens, mask, samples = make_step(10)
    with TokenLogger(tmp_path, "frac", strict=False) as lg:
        with pytest.warns(LogWarning, match=r"tokens\['token_id'\]: expected integers, got \d+\.5"):
            lg.log_step(0, tokens={**tokens, "token_id": tokens["token_id"] + 0.5}, mask=mask, samples=samples)
        lg.log_step(1, tokens=tokens, mask=mask, samples=samples)
    assert set(read(tmp_path / "frac", "tokens")["step"].to_pylist()) == {1}


def test_files_rotate_at_flush_rows_and_name_their_steps(tmp_path):
    tokens, mask, samples = make_step(11)
    with TokenLogger(tmp_path, "rot", flush_rows=int(mask.sum()) * 2, row_group_size=7, write_threads=1) as lg:
        for step in range(5):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
    files = sorted((tmp_path / "rot" / "tokens").rglob("*.parquet"))
    spans = [tuple(int(x) for x in f.name.split("-")[1:3] if x.isdigit()) for f in files]
    assert [f.name.split("-")[1:3] for f in files] == [["s00000000", "00000001"], ["s00000002", "00000003"],
                                                        ["s00000004", "00000004"]], spans
    assert pq.ParquetFile(files[0]).metadata.num_row_groups == -(-2 * int(mask.sum()) // 7)
    assert read(tmp_path / "rot", "tokens").num_rows == 5 * mask.sum()


def test_two_write_threads_split_a_flush_into_parts_committed_together(tmp_path):
    tokens, mask, samples = make_step(11)
    with TokenLogger(tmp_path, "one", row_group_size=7, write_threads=1) as lg:
        for step in range(3):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
    with TokenLogger(tmp_path, "two", row_group_size=7, write_threads=2) as lg:
        for step in range(3):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
    names = sorted(p.name for p in (tmp_path / "two" / "tokens").rglob("*.parquet"))
    assert names == ["r0000-s00000000-00000002-f00000001-p00.parquet", "r0000-s00000000-00000002-f00000001-p01.parquet"]
    assert {S.parse_data_file(n).flush for n in names} == {1}
    one, two = read(tmp_path / "one", "tokens"), read(tmp_path / "two", "tokens")
    assert one.drop(["run_id"]).equals(two.drop(["run_id"]))
    assert not S.validate_run(tmp_path / "two")


def test_the_callers_buffers_may_be_reused_once_log_step_returns(tmp_path):
    """log_step keeps its own copy of arrays and CPU tensors (a trainer refills its buffers for the next step),
    every mask full so that nothing is gathered; the writer thread runs after the buffers were overwritten."""
    import torch

    tokens, _, samples = make_step()
    full = np.ones((B, T), dtype=bool)
    given = {**tokens, "mu_logprob": torch.from_numpy(tokens["mu_logprob"].copy()),
             "mu_topk_logprobs": torch.from_numpy(tokens["mu_topk_logprobs"].copy())}
    want = {name: np.array(given[name]) for name in ("mu_logprob", "pi_logprob", "mu_topk_logprobs", "token_id")}
    with TokenLogger(tmp_path, "reuse", max_queue=4) as lg:
        lg.log_step(0, tokens=given, mask=full, samples=samples)
        for name in want:  # the next step's values, written into the same memory
            buf = given[name]
            (buf.fill_(-1.0) if isinstance(buf, torch.Tensor) else buf.fill(-1 if buf.dtype.kind == "f" else 7))
    got = read(tmp_path / "reuse", "tokens")
    order = np.lexsort((got["pos"].to_numpy(), got["sample_id"].to_numpy()))
    for name, values in want.items():
        logged = got[name].to_numpy(zero_copy_only=False)[order]
        logged = np.stack(logged) if logged.dtype == object else logged
        np.testing.assert_array_equal(logged.reshape(values.shape), values, err_msg=name)


def _text_call(rng, b: int, t: int, vocab: list[str]) -> tuple[dict, np.ndarray]:
    ids = rng.integers(0, len(vocab), (b, t))
    mu = -rng.random((b, t)).astype(np.float32)
    return {"tokens": {"token_id": ids, "mu_logprob": mu, "pi_logprob": mu, "advantage": rng.normal(size=b)},
            "mask": np.ones((b, t), bool),
            "samples": {"sample_id": np.arange(b), "prompt_id": np.zeros(b, int), "reward": rng.random(b),
                        "response_token_ids": list(ids), "prompt": [f"p{i}" for i in range(b)]}}, ids


def test_texts_are_decoded_on_the_writer_thread_for_the_text_fraction_sample(tmp_path):
    """Token ids given for the response are decoded with the logger's vocab; by default the texts of exactly the
    responses whose tokens are logged are kept, every sample keeps its numbers; text_fraction sets its own share."""
    vocab = [chr(97 + i) for i in range(26)]
    rng = np.random.default_rng(0)
    call, ids = _text_call(rng, 64, 5, vocab)
    with TokenLogger(tmp_path, "default", vocab=vocab, token_fraction=0.25) as lg:
        lg.log_step(0, **call)
    samples = pq.read_table(tmp_path / "default" / "samples").to_pandas().sort_values("sample_id")
    tokens = pq.read_table(tmp_path / "default" / "tokens").to_pandas()
    texted = samples[samples["response"].notna()]
    assert len(samples) == 64 and samples["reward"].notna().all()
    assert sorted(texted["sample_id"]) == sorted(set(tokens["sample_id"])) and 0 < len(texted) < 64
    assert samples["prompt"].notna().sum() == len(texted)  # texts given as strings are sampled alike
    assert all(row.response == "".join(vocab[i] for i in ids[row.sample_id]) for row in texted.itertuples())
    assert json.loads((tmp_path / "default" / "run.json").read_text())["logging"]["text_fraction"] == 0.25
    with TokenLogger(tmp_path, "all-text", vocab=vocab, token_fraction=0.25, text_fraction=1.0) as lg:
        lg.log_step(0, **call)
    assert pq.read_table(tmp_path / "all-text" / "samples").column("response").null_count == 0
    with TokenLogger(tmp_path, "bad", vocab=vocab) as lg:
        call["samples"]["response_token_ids"][3] = np.array([1, 99])
        with pytest.raises(SchemaError, match=r"samples\['response_token_ids'\] holds token id 99, outside the "
                                              r"vocab \[0, 26\)"):
            lg.log_step(0, **call)
        call["samples"]["response"] = ["x"] * 64
        with pytest.raises(SchemaError, match=r"are both given"):
            lg.log_step(0, **call)
    with TokenLogger(tmp_path, "novocab") as lg, pytest.raises(SchemaError, match=r"needs the logger's vocab"):
        lg.log_step(0, **_text_call(rng, 2, 3, vocab)[0])
    with pytest.raises(ValueError, match=r"text_fraction must be in \[0, 1\]"):
        TokenLogger(tmp_path, "x", text_fraction=1.5)


def test_commit_step_commits_without_closing_and_cut_back_drops_the_later_steps(tmp_path):
    """commit_step: the step becomes visible while the logger stays open; cut_back on a resumed logger drops the
    steps after the checkpoint, only before the first log_step; a flush across the cut is refused, not kept."""
    from trustscope.logger import ResumeError, drop_steps_after

    vocab = [chr(97 + i) for i in range(26)]
    rng = np.random.default_rng(1)
    lg = TokenLogger(tmp_path, "c", vocab=vocab, flush_seconds=3600)
    for step in range(4):
        lg.log_step(step, **_text_call(rng, 4, 3, vocab)[0])
        lg.commit_step()
    deadline = 50
    while json.loads((tmp_path / "c" / S.MANIFEST).read_text()).get("last_step") != 3 and deadline:
        threading.Event().wait(0.1)
        deadline -= 1
    assert json.loads((tmp_path / "c" / S.MANIFEST).read_text())["status"] == "running" and deadline
    lg.close()
    with TokenLogger(tmp_path, "new", vocab=vocab) as fresh, pytest.raises(RuntimeError, match="resume=True"):
        fresh.cut_back(0)
    with TokenLogger(tmp_path, "c", vocab=vocab, resume=True) as lg:
        assert lg.cut_back(1) > 0
        lg.log_step(2, **_text_call(rng, 4, 3, vocab)[0])
        with pytest.raises(RuntimeError, match="before its first log_step"):
            lg.cut_back(1)
        lg.log_step(3, **_text_call(rng, 4, 3, vocab)[0])  # steps 2 and 3 in one flush
    assert pq.read_table(tmp_path / "c" / "samples").to_pandas().groupby("step").size().tolist() == [4] * 4
    with pytest.raises(ResumeError, match=r"rank 0: flush \d+ holds steps 2-3, on both sides of step 2"):
        drop_steps_after(tmp_path / "c", 2)
    assert S.validate_logdir(tmp_path) == []


def test_cut_back_first_rolls_forward_a_flush_a_killed_writer_left_half_in_place(tmp_path):
    """A writer killed between committing a flush and renaming its files into place (the manifest's
    ``publishing``) leaves part of the flush at its final names, part at temporary ones. A resume cut back before
    that flush must remove all of it: recovery first rolls it forward, then the cut drops it, and the resumed
    logger writes the later steps again (before, the half in place escaped the cut: "step 2 is not after step
    3" at the resumed run's next step)."""
    from trustscope.logger import drop_steps_after

    tokens, mask, samples = make_step(5)
    with TokenLogger(tmp_path, "half", flush_seconds=3600) as lg:
        for step in range(4):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
            if step != 2:  # steps 2 and 3 in one flush
                lg.commit_step()
    run = tmp_path / "half"
    manifest = json.loads((run / S.MANIFEST).read_text())
    late = sorted(p for p in run.rglob("*.parquet") if S.parse_data_file(p.name).first_step >= 2)
    assert len(late) >= 2, late  # the flush of steps 2-3 in several tables
    entries = []
    for path in late[1:]:  # the first table's file landed, the others were still temporaries
        tmp = path.with_name(path.name + ".tmp")
        path.rename(tmp)
        entries.append([str(tmp.relative_to(run)), str(path.relative_to(run)), 1])
    entries.append([None, str(late[0].relative_to(run)), 1])
    (run / S.MANIFEST).write_text(json.dumps({**manifest, "publishing": entries}))
    assert drop_steps_after(run, 1, resume=True) >= len(late)
    assert not [p for p in run.rglob("*.parquet*") if p in late or p.name.endswith(".tmp")]
    with TokenLogger(tmp_path, "half", resume=True) as lg:
        for step in (2, 3):
            lg.log_step(step, tokens=tokens, mask=mask, samples=samples)
    assert sorted(set(read(run, "tokens")["step"].to_pylist())) == [0, 1, 2, 3]
    assert read(run, "tokens").num_rows == 4 * int(mask.sum())
    assert S.validate_logdir(tmp_path) == []
