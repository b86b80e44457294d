"""The frameworks' own mismatch figures reproduced from the log (trustscope/framework_metrics.py and its views).

verl's figures are held to verl's own functions (the installed package) run on the very tensors logged through
TokenLogger; prime-rl's and slime's (not installed) to their formulas as their source writes them, each cited.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch

from trustscope import framework_metrics as fm
from trustscope.logger import TokenLogger

DOC = Path(__file__).resolve().parent.parent / "docs" / "frameworks-metrics.md"


def batch(seed: int = 0, B: int = 7, T: int = 13) -> dict[str, torch.Tensor]:
    """A verl-shaped batch: right-padded responses of 2..T tokens, rollout log-probs and a training recompute that
    strays from them (some IS ratios beyond 2 and below 1/2)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    rollout = torch.log(torch.rand(B, T, generator=g) * 0.95 + 0.05)  # (B, T)
    old = torch.clamp(rollout + 0.45 * torch.randn(B, T, generator=g), max=0.0)  # (B, T)
    pi = torch.clamp(old + 0.05 * torch.randn(B, T, generator=g), max=0.0)  # (B, T): not what verl compares
    return {"mask": mask, "rollout": rollout.float(), "old": old.float(), "pi": pi.float(),
            "token_id": torch.randint(0, 50, (B, T), generator=g)}


def log_and_read(tmp_path: Path, steps: dict[int, list[dict]], run_id: str = "run",
                 extra_columns: dict[str, str] | None = None, token_fraction: float = 1.0) -> pa.Table:
    """Log each step's calls through TokenLogger, then read the committed token rows back."""
    with TokenLogger(tmp_path, run_id, extra_columns=extra_columns, token_fraction=token_fraction) as logger:
        for step, calls in steps.items():
            for call in calls:
                mask = call.pop("mask")
                call.setdefault("prompt_id", np.arange(mask.shape[0]) // 2)
                logger.log_step(step, mask=mask, tokens=call)
    return ds.dataset(tmp_path / run_id / "tokens", format="parquet").to_table()


def verl_tokens(b: dict[str, torch.Tensor], kept: torch.Tensor | None = None) -> dict:
    kept = b["mask"] if kept is None else kept
    return {"mask": b["mask"], "token_id": b["token_id"], "mu_logprob": b["rollout"], "old_logprob": b["old"],
            "pi_logprob": b["pi"], "advantage": torch.zeros_like(b["old"]), "kept": kept,
            "rollout_rejected": b["mask"] & ~kept}


def view_row(table: pa.Table, **key) -> dict:
    rows = [r for r in table.to_pylist() if all(r[k] == v for k, v in key.items())]
    assert len(rows) == 1, (key, len(rows))
    return rows[0]


def close(ours: float, theirs: float, name: str) -> None:
    assert math.isclose(ours, theirs, rel_tol=2e-5, abs_tol=2e-6), f"{name}: trustscope {ours!r}, framework {theirs!r}"


# ------------------------------------------------------------------------------------------------------------ verl


@pytest.fixture(scope="module")
def verl_helpers():
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    debug = pytest.importorskip("verl.utils.debug.metrics")
    from verl import DataProto

    return helper, debug, DataProto


@pytest.mark.parametrize(("rollout_is", "threshold", "lower"), [("token", 2.0, 0.0), ("sequence", 2.0, 0.0),
                                                                 ("token", "0.6_1.5", 0.6)])
def test_verl_figures_are_verls_own(tmp_path, verl_helpers, rollout_is, threshold, lower):
    """verl's compute_rollout_correction_and_rejection_mask (rollout_corr/*: off-policy figures, IS weights at
    the level and threshold, token_k1 rejection sampling) and calculate_debug_metrics (training/rollout_*), run on
    the batch trustscope logs, give the numbers of trustscope's views over the logged rows."""
    helper, debug, DataProto = verl_helpers
    b = batch(seed=3)
    _, kept, theirs = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=b["old"], rollout_log_prob=b["rollout"], response_mask=b["mask"].float(),
        rollout_is=rollout_is, rollout_is_threshold=threshold, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    theirs.update(debug.calculate_debug_metrics(DataProto.from_dict(tensors={
        "rollout_log_probs": b["rollout"], "old_log_probs": b["old"], "response_mask": b["mask"].long(),
        "responses": b["token_id"]})))
    kept = kept.bool() & b["mask"]
    assert (b["mask"] & ~kept).any(), "the rejection sampling rejects some tokens of this batch"
    rows = log_and_read(tmp_path, {5: [verl_tokens(b, kept)]})
    upper = float(threshold) if not isinstance(threshold, str) else float(threshold.split("_")[1])
    params = {"verl_rollout_is_threshold": upper, "verl_rollout_is_threshold_lower": lower}
    corr = view_row(fm.compute(rows, "verl_rollout_corr"), step=5)
    is_row = view_row(fm.compute(rows, "verl_rollout_is", analysis=params), step=5, rollout_is=rollout_is)
    assert corr["training_side"] == "old_logprob"
    assert corr["n_tokens"] == int(b["mask"].sum()) and corr["n_sequences"] == b["mask"].shape[0]
    compared = set()
    for m in fm.metrics_of("verl"):
        ours = (is_row if m.view == "verl_rollout_is" else corr)[m.name]
        if m.name not in theirs:
            assert m.name == "rollout_corr/rollout_is_oob_ratio" and not lower and ours is None, m.name
            continue
        close(ours, theirs[m.name], m.name)
        compared.add(m.name)
    left = {k for k in theirs if k not in compared}
    assert all(k.startswith("rollout_corr/rollout_rs_token_k1") for k in left), sorted(left)
    assert len(compared) >= 33


@pytest.mark.parametrize("same_ids", [True, False])
def test_verl_figures_with_two_updates_a_step(tmp_path, verl_helpers, same_ids):
    """A step whose responses are trained by two updates (ppo_epochs 2: each response logged once per update, with
    update_index, under the same sample ids or new ones) gives verl's figures of the one batch: a sequence is a
    sample_id once per update, so its sums are not doubled; only the sample standard deviations, taken over the
    repeated values, are left out of the comparison."""
    helper = verl_helpers[0]
    b = batch(seed=8)
    _, _, theirs = helper.compute_rollout_correction_and_rejection_mask(
        b["old"], b["rollout"], b["mask"].float(), rollout_is="sequence", rollout_is_threshold=2.0)
    calls = []
    for update in (0, 1):
        tokens = verl_tokens(b)
        del tokens["rollout_rejected"]
        offset = 0 if same_ids else 100 * update
        calls.append({**tokens, "update_index": np.full(b["mask"].shape[0], update),
                      "sample_id": np.arange(b["mask"].shape[0]) + offset})
    rows = log_and_read(tmp_path, {1: calls})
    assert rows.num_rows == 2 * int(b["mask"].sum())
    corr = view_row(fm.compute(rows, "verl_rollout_corr"), step=1)
    is_row = view_row(fm.compute(rows, "verl_rollout_is"), step=1, rollout_is="sequence")
    sample_std = {"training/rollout_probs_diff_std", "rollout_corr/rollout_is_seq_std"}
    for m in fm.metrics_of("verl"):
        if m.name in theirs and m.name not in sample_std:
            close((is_row if m.view == "verl_rollout_is" else corr)[m.name], theirs[m.name], m.name)
    assert corr["n_sequences"] == 2 * b["mask"].shape[0]


def test_verl_long_view_and_exact_flag(tmp_path, verl_helpers):
    """The long view names each figure as verl logs it, under its variant, and says a figure over a sample of
    the token rows (token_fraction < 1) is not exact."""
    helper = verl_helpers[0]
    b = batch(seed=5)
    tokens = verl_tokens(b)
    del tokens["rollout_rejected"]
    rows = log_and_read(tmp_path, {0: [tokens]})
    theirs = helper.compute_offpolicy_metrics(old_log_prob=b["old"], rollout_log_prob=b["rollout"],
                                              response_mask=b["mask"].float())
    long = fm.compute(rows).to_pylist()
    by_name = {(r["metric"], r["variant"]): r for r in long if r["framework"] == "verl"}
    for key, value in theirs.items():
        close(by_name[(f"rollout_corr/{key}", None)]["value"], value, key)
    assert {r["variant"] for r in long if r["metric"] == "rollout_corr/rollout_is_mean"} == {
        "rollout_is=token", "rollout_is=sequence"}
    assert all(r["exact"] for r in long)
    assert not any(r["exact"] for r in fm.compute(rows, token_fraction=0.25).to_pylist())
    assert "rollout_corr/rollout_rs_masked_fraction" not in {m for m, _ in by_name}, \
        "no rejection column given: no rejected share (null, left out), not a made-up 0"


# -------------------------------------------------------------------------------------------------------- prime-rl


def prime_rl_stats(trainer: torch.Tensor, inference: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """prime-rl's mismatch_kl figures, as its source computes them: src/prime_rl/trainer/rl/loss.py
    compute_importance_ratio_and_mismatch_kl (mismatch_kl = exp(l) - l - 1, l = trainer - inference), train.py
    (``mismatch_kl[mismatch_mask]`` with mismatch_mask = loss_mask, concatenated over micro-steps and ranks) and
    utils.py Tensors.compute_stats (mean, torch.median, std, min, max of the 1-D tensor)."""
    log_ratio = trainer - inference
    values = (torch.exp(log_ratio) - log_ratio - 1)[loss_mask]
    return {"mean": values.mean().item(), "median": torch.median(values).item(), "std": values.std().item(),
            "min": values.min().item(), "max": values.max().item()}


def test_prime_rl_mismatch_kl(tmp_path):
    """mismatch_kl/{all,<env>}/{mean,median,std,min,max} over two micro-batches of a step, per environment of the
    run's own ``env`` column, equal prime-rl's formula on the same tensors (an even token count, so the median is
    torch's lower middle value, not the average of the two)."""
    parts = [batch(seed=s, B=4, T=9) for s in (11, 12)]
    envs = [np.array(["gsm8k", "gsm8k", "code", "code"], dtype=object), np.array(["code"] * 4, dtype=object)]
    calls = [{"mask": p["mask"], "token_id": p["token_id"], "mu_logprob": p["rollout"], "pi_logprob": p["old"],
              "advantage": torch.zeros_like(p["old"]), "kept": p["mask"], "env": e} for p, e in zip(parts, envs,
                                                                                              strict=True)]
    total = sum(int(p["mask"].sum()) for p in parts)
    if total % 2:  # make the count even: the median must be torch's lower middle value
        parts[1]["mask"][0, int(parts[1]["mask"][0].sum()) - 1] = False
    rows = log_and_read(tmp_path, {2: calls}, extra_columns={"env": "string"})
    table = fm.compute(rows, "prime_rl_mismatch_kl")
    trainer = torch.cat([p["old"].flatten() for p in parts])
    inference = torch.cat([p["rollout"].flatten() for p in parts])
    mask = torch.cat([p["mask"].flatten() for p in parts])
    env = np.concatenate([np.repeat(e[:, None], p["mask"].shape[1], axis=1).ravel() for p, e in zip(parts, envs,
                                                                                                   strict=True)])
    assert int(mask.sum()) % 2 == 0
    expected = {"all": prime_rl_stats(trainer, inference, mask)}
    for name in ("gsm8k", "code"):
        expected[name] = prime_rl_stats(trainer, inference, mask & torch.from_numpy(env == name))
    assert sorted(table.column("env").to_pylist()) == sorted(expected)
    for name, stats in expected.items():
        row = view_row(table, env=name)
        for stat, value in stats.items():
            close(row[stat], value, f"mismatch_kl/{name}/{stat}")
    long = {r["metric"]: r["value"] for r in fm.compute(rows).to_pylist() if r["framework"] == "prime-rl"}
    close(long["mismatch_kl/code/median"], expected["code"]["median"], "long view")


# ----------------------------------------------------------------------------------------------------------- slime


def slime_figures(train: list[torch.Tensor], rollout: list[torch.Tensor], tis_clip: float, tis_clip_low: float,
                  per_token: bool) -> dict[str, float]:
    """slime's train_rollout_logprob_abs_diff, tis, tis_clipfrac and tis_abs for one step, as its source computes
    them: slime/backends/megatron_utils/loss.py policy_loss_function (|log_probs - rollout_log_probs|, log_probs
    being batch["log_probs"]) and vanilla_tis_function (tis = exp(old - rollout), clipfrac = clamp(tis, low, clip)
    != tis, tis_abs = |tis - 1|), reduced by cp_utils.py get_sum_of_sample_mean (each sample's masked sum over its
    rollout's mask total; sum_of_token with calculate_per_token_loss) and train_metric_utils.py
    reduce_train_step_metrics (divided by step_global_batch_size, the rollout count, or by the token count).
    Every sample is its own rollout and the loss mask is all ones."""
    old, roll = torch.cat(train), torch.cat(rollout)
    tis = torch.exp(old - roll)
    per_tok = {"train_rollout_logprob_abs_diff": (old - roll).abs(), "tis": tis,
               "tis_clipfrac": (torch.clamp(tis, min=tis_clip_low, max=tis_clip) != tis).float(),
               "tis_abs": (torch.exp(old - roll) - 1).abs()}
    lengths = [len(t) for t in train]
    out = {}
    for name, x in per_tok.items():
        if per_token:
            out[name] = (sum(x_i.sum() for x_i in x.split(lengths)) / sum(lengths)).item()
        else:
            out[name] = (sum(x_i.sum() / max(n, 1) for x_i, n in zip(x.split(lengths), lengths, strict=True))
                         / len(lengths)).item()
    return out


@pytest.mark.parametrize("per_token", [False, True])
def test_slime_figures(tmp_path, per_token):
    """slime's four figures at its default reducer (per-rollout mean) and with --calculate-per-token-loss, at
    clip bounds other than the defaults, equal slime's formulas on the logged tensors."""
    b = batch(seed=21)
    rows = log_and_read(tmp_path, {4: [verl_tokens(b)]})
    train = [b["old"][i][b["mask"][i]] for i in range(b["mask"].shape[0])]
    rollout = [b["rollout"][i][b["mask"][i]] for i in range(b["mask"].shape[0])]
    expected = slime_figures(train, rollout, tis_clip=1.5, tis_clip_low=0.5, per_token=per_token)
    assert 0 < expected["tis_clipfrac"] < 1
    table = fm.compute(rows, "slime_mismatch", analysis={"slime_tis_clip": 1.5, "slime_tis_clip_low": 0.5})
    row = view_row(table, reducer="per_token" if per_token else "per_rollout_mean")
    for name, value in expected.items():
        close(row[name], value, name)


# ------------------------------------------------------------------------------------------------------------- TRL


def trl_figures(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None,
                clip_max: float | None) -> dict[str, float]:
    """TRL's sampling figures of one generation batch on one process, as trl/trainer/grpo_trainer.py (TRL 1.16)
    GRPOTrainer._generate_and_score_completions writes them: per_token_logps_diff = (old_per_token_logps -
    sampling_per_token_logps) * mask, summed per sequence in the sequence_* modes, exp, clamped (*_truncate) or
    zeroed outside [clip_min, clip_max] (*_mask); sampling_logp_difference = |old - sampling| over the mask (mean,
    max); importance_sampling_ratio min/mean/max over the masked tokens or, in sequence modes, the sequences. The
    method builds its batch from a live generation, so the test runs these lines, not the method."""
    diff = (old - sampling) * mask
    sequence_level = mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence_level else diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)
    delta = torch.abs(old - sampling)[mask]
    flat = ratio.flatten() if sequence_level else ratio[mask]
    return {"sampling/sampling_logp_difference/mean": torch.mean(delta).item(),
            "sampling/sampling_logp_difference/max": torch.max(delta).item(),
            "sampling/importance_sampling_ratio/min": torch.min(flat).item(),
            "sampling/importance_sampling_ratio/mean": torch.mean(flat).item(),
            "sampling/importance_sampling_ratio/max": torch.max(flat).item()}


def test_trl_sampling_figures(tmp_path):
    """TRL's sampling_logp_difference and importance_sampling_ratio figures in each vllm_importance_sampling_mode,
    at TRL's default bounds (min None, max 3) and at [0.96, 1.04], where both bounds cut tokens and sequences,
    equal TRL's lines on the logged tensors."""
    b = batch(seed=31)
    b["old"] = torch.clamp(b["rollout"] + 0.08 * (b["old"] - b["rollout"]), max=0.0)  # sequences near ratio 1
    token_ratio = torch.exp(b["old"] - b["rollout"])[b["mask"]]
    sequence_ratio = torch.exp(((b["old"] - b["rollout"]) * b["mask"]).sum(-1))
    for ratio in (token_ratio, sequence_ratio):
        assert (ratio < 0.96).any() and (ratio > 1.04).any() and ((ratio > 0.96) & (ratio < 1.04)).any()
    rows = log_and_read(tmp_path, {3: [verl_tokens(b)]})
    modes = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
    for clip_min, clip_max in ((None, 3.0), (0.96, 1.04)):
        table = fm.compute(rows, "trl_sampling", analysis={"trl_is_clip_min": clip_min or 0.0,
                                                           "trl_is_clip_max": clip_max})
        for mode in modes:
            row = view_row(table, vllm_importance_sampling_mode=mode)
            for name, value in trl_figures(b["old"], b["rollout"], b["mask"], mode, clip_min, clip_max).items():
                close(row[name], value, f"{name} ({mode}, [{clip_min}, {clip_max}])")
    long = [r for r in fm.compute(rows).to_pylist() if r["framework"] == "trl"]
    assert {r["variant"] for r in long if r["metric"] == "sampling/sampling_logp_difference/mean"} == {None}
    assert {r["variant"] for r in long} - {None} == {f"vllm_importance_sampling_mode={m}" for m in modes}


# -------------------------------------------------------------------------------------------------------- trackers


def test_tracker_metrics_name_the_frameworks_figures(tmp_path, verl_helpers):
    """StepReporter with a FrameworkReporter adds the frameworks' figures of the newest committed step, each step
    once, named ``trustscope/<the framework's name>``, equal to verl's function on that step's tensors; the last
    step arrives at the end of the run; a sampled logger's figures say they are not exact."""
    from trustscope.trackers import FrameworkReporter, StepReporter

    helper = verl_helpers[0]
    batches = {step: batch(seed=40 + step) for step in range(3)}
    with TokenLogger(tmp_path, "live") as logger:
        for step, b in batches.items():
            tokens = verl_tokens(b)
            mask = tokens.pop("mask")
            logger.log_step(step, mask=mask, tokens={**tokens, "prompt_id": np.arange(mask.shape[0])})
        logger.flush()
        frameworks = FrameworkReporter(logger.run_dir, ["verl", "slime"])
        reporter = StepReporter(logger, frameworks=frameworks)
        first = reporter.metrics()
        assert reporter.metrics() == {}, "each step once"
    assert first["trustscope/frameworks/step"] == 1.0 and first["trustscope/frameworks/exact"] == 1.0
    assert first["trustscope/step"] == 2.0, "the summaries' own step beside it"
    b = batches[1]
    theirs = helper.compute_rollout_corr_metrics_from_logprobs(b["old"], b["rollout"], b["mask"].float())
    for name, value in theirs.items():
        close(first[f"trustscope/{name}"], value, name)
    _, _, seq = helper.compute_rollout_correction_and_rejection_mask(b["old"], b["rollout"], b["mask"].float(),
                                                                     rollout_is="sequence")
    close(first["trustscope/rollout_corr/rollout_is_mean"], seq["rollout_corr/rollout_is_mean"], "sequence level")
    assert "trustscope/tis" in first and not any(k.startswith("trustscope/mismatch_kl/") for k in first)
    last = frameworks.metrics(final=True)
    assert last["trustscope/frameworks/step"] == 2.0 and frameworks.metrics(final=True) == {}
    token_level = FrameworkReporter(tmp_path / "live", ["verl"], variants={"verl": "rollout_is=token"},
                                    token_fraction=0.5).metrics()
    _, _, tok = helper.compute_rollout_correction_and_rejection_mask(b["old"], b["rollout"], b["mask"].float(),
                                                                     rollout_is="token")
    close(token_level["trustscope/rollout_corr/rollout_is_mean"], tok["rollout_corr/rollout_is_mean"], "token level")
    assert token_level["trustscope/frameworks/exact"] == 0.0
    trl = FrameworkReporter(tmp_path / "live", ["trl"]).metrics()
    expected = trl_figures(b["old"], b["rollout"], b["mask"], "sequence_mask", None, 3.0)
    close(trl["trustscope/sampling/importance_sampling_ratio/mean"],
          expected["sampling/importance_sampling_ratio/mean"], "TRL's default mode")
    with pytest.raises(KeyError, match="'nemo'"):
        FrameworkReporter(tmp_path / "live", ["nemo"])


# ---------------------------------------------------------------------------------------- log directory, report


def test_log_directory_views_and_report_section(tmp_path, verl_helpers):
    """Through a log directory (connect): the views equal verl's figures, the thresholds bind per cursor, and the
    report section shows a verl run's own figures with the sequences behind the worst step; a run from no such
    framework gets the one line naming the view."""
    import io

    from rich.console import Console

    from trustscope.db import connect
    from trustscope.report_frameworks import frameworks_part

    helper = verl_helpers[0]
    batches = {step: batch(seed=60 + step) for step in range(2)}
    with TokenLogger(tmp_path, "verl-run", source={"framework": "verl", "version": "0.9.1"}) as logger:
        for step, b in batches.items():
            tokens = verl_tokens(b)
            mask = tokens.pop("mask")
            logger.log_step(step, mask=mask, tokens={**tokens, "prompt_id": np.arange(mask.shape[0])})
    log_and_read(tmp_path, {0: [verl_tokens(batch(seed=1))]}, run_id="own-loop")
    with connect(tmp_path) as db:
        cur = db.cursor(verl_rollout_is_threshold=1.3)
        corr = cur.sql("select * from verl_rollout_corr where run_id = 'verl-run' order by step").to_arrow_table()
        is_rows = cur.sql("select * from verl_rollout_is where run_id = 'verl-run' and rollout_is = 'token' "
                          "order by step").to_arrow_table().to_pylist()
        cur.close()
        for step, b in batches.items():
            _, _, theirs = helper.compute_rollout_correction_and_rejection_mask(
                b["old"], b["rollout"], b["mask"].float(), rollout_is="token", rollout_is_threshold=1.3)
            close(corr.column("rollout_corr/chi2_seq")[step].as_py(), theirs["rollout_corr/chi2_seq"], "chi2_seq")
            close(is_rows[step]["rollout_corr/rollout_is_mean"], theirs["rollout_corr/rollout_is_mean"], "is mean")
        console = Console(file=io.StringIO(), width=200, record=True)
        console.print(frameworks_part(db, ["verl-run", "own-loop"]))
        text = console.export_text()
    worst = int(np.argmax([c.as_py() for c in corr.column("rollout_corr/chi2_seq")]))
    assert "verl-run: verl's own figures" in text and "rollout_corr/k3_kl" in text
    assert f"rollout_corr/chi2_seq at its largest (step {worst})" in text and "sample_id" in text
    assert "own-loop" in text and "framework_metrics" in text
    assert "estimates" not in text


# ------------------------------------------------------------------------------------------ declarations and docs


def test_views_hold_every_declared_figure(tmp_path):
    """Each declared figure is a column (or, for prime-rl, a statistic) of its view, and the long view names no
    figure that is not declared."""
    b = batch(seed=1)
    rows = log_and_read(tmp_path, {0: [verl_tokens(b)]})
    for view in ("verl_rollout_corr", "verl_rollout_is", "slime_mismatch", "trl_sampling"):
        declared = {m.name for m in fm.METRICS if m.view == view}
        columns = set(fm.compute(rows, view).column_names)
        assert declared <= columns, sorted(declared - columns)
        figures = {c for c in columns if "/" in c or c in {"tis", "tis_clipfrac", "tis_abs",
                                                             "train_rollout_logprob_abs_diff"}}
        assert figures == declared, sorted(figures ^ declared)
    long = fm.compute(rows).to_pylist()
    names = {m.name.replace("{env}", "all") for m in fm.METRICS}
    assert {r["metric"] for r in long} - names == set()
    assert {r["framework"] for r in long} == set(fm.FRAMEWORK_NAMES)


def test_bad_input_names_the_field():
    rows = pa.table({"run_id": ["r"], "step": [0], "sample_id": [0], "mu_logprob": [-0.1]})
    with pytest.raises(ValueError, match="'pi_logprob'"):
        fm.compute(rows)
    with pytest.raises(ValueError, match="'tis_clip'"):
        fm.compute(rows, analysis={"tis_clip": 2.0})
    with pytest.raises(ValueError, match="'verl_metrics'"):
        fm.compute(rows, "verl_metrics")
    with pytest.raises(KeyError, match="'openrlhf'"):
        fm.metrics_of("openrlhf")


def test_docs_tables_are_the_declarations():
    """docs/frameworks-metrics.md's tables are generated from the declarations (rewrite them with
    ``python tests/test_framework_metrics.py --write``)."""
    text = DOC.read_text()
    assert fm.metrics_markdown() in text
    assert fm.frameworks_markdown() in text


def write_docs() -> None:
    """Regenerate the two tables of docs/frameworks-metrics.md between their markers."""
    text = DOC.read_text()
    for marker, block in (("metrics", fm.metrics_markdown()), ("frameworks", fm.frameworks_markdown())):
        start, end = f"<!-- {marker} table -->\n", f"<!-- end {marker} table -->"
        head, rest = text.split(start)
        _, tail = rest.split(end)
        text = head + start + block + end + tail
    DOC.write_text(text)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write"]:
        write_docs()
