"""trustscope.integrations.verl against the real verl package: its policy-loss registry and plugin entry point,
``DataProto``, verl's own ``ppo_loss`` called as its actor calls it, the logging hook, and a local Ray worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
import warnings
from functools import partial
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from bench.verl_batches import actor_config, make_batch, model_output
from trustscope import db as tdb
from trustscope import losses as L
from trustscope import runformat as S
from trustscope.columns import turns_from_mask
from trustscope.integrations import verl as tv
from trustscope.logger import LogWarning, TokenLogger, run_status

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------- verl batches


def run_actor(batch: DataProto, pi: torch.Tensor, loss_fn, *, mini: int = 4, micro: int = 2, epochs: int = 1,
              entropy: torch.Tensor | None = None, dp_size: int = 1, max_tokens: int | None = None) -> list[list[tuple]]:
    """The actor update as verl 0.9.1 runs it, the model's forward replaced by ``pi``.

    ``RayPPOTrainer._update_actor`` (to_tensordict, left_right_2_no_padding, global batch size), then
    ``TrainingWorker.train_mini_batch`` (make_iterator over mini-batches and epochs, shuffled) and the engine's
    ``forward_backward_batch`` (batch_num_tokens, dp_size, prepare_micro_batches, ``loss_fn(model_output=...,
    data=micro_batch, dp_group=...)``). ``max_tokens``: verl's dynamic batch size (micro-batches of at most that
    many tokens, rows regrouped by length) instead of ``micro`` rows. Returns, per mini-batch, (sample ids, loss,
    metrics) per micro-batch.
    """
    if tv.STEP_KEY in batch.meta_info:  # as the driver's attach stamps it: the updates the call makes
        batch.meta_info[tv.UPDATES_KEY] = tv.updates_of_call(len(batch), mini, epochs)
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=mini, use_dynamic_bsz=max_tokens is not None,
                         micro_batch_size_per_gpu=micro, max_token_len_per_gpu=max_tokens or 0)
    out = []
    for mini_td in tu.make_iterator(td, mini_batch_size=mini, epochs=epochs, seed=42,
                                    dataloader_kwargs={"shuffle": True}):
        tu.assign_non_tensor(mini_td, batch_num_tokens=int(mini_td["loss_mask"].sum()), dp_size=dp_size)
        micro_batches, _ = prepare_micro_batches(mini_td)
        results = []
        for mb in micro_batches:
            loss, metrics = loss_fn(model_output=model_output(mb, pi, entropy), data=mb, dp_group=None)
            results.append((mb[tv.SAMPLE_KEY].tolist(), loss, metrics))
        out.append(results)
    return out


def stamped(batch: DataProto, tmp_path: Path, step: int = 1) -> DataProto:
    with TokenLogger(tmp_path / "drv", rank=0) as logger:
        tv.log_driver_batch(logger, batch, step)
    return batch


# ---------------------------------------------------------------------------------------------------- registry


def test_every_rule_without_topk_is_a_verl_loss_mode():
    modes = tv.register_policy_losses()
    for name in L.list_losses():
        mode = tv.verl_loss_mode(name)
        if L.get_loss(name).needs & {"mu_topk_logprobs", "pi_topk_logprobs"}:
            assert mode not in core_algos.POLICY_LOSS_REGISTRY, name
        else:
            assert mode in modes
            assert callable(core_algos.get_policy_loss_fn(mode))
    assert "trustscope_dppo_binary_tv" in modes and len(modes) >= 10


def test_a_rule_registered_later_becomes_a_loss_mode(monkeypatch):
    monkeypatch.setattr(L, "_REGISTRY", dict(L._REGISTRY))
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", dict(core_algos.POLICY_LOSS_REGISTRY))
    L.register_loss("verl_test_tight_tv", doc="DPPO binary TV with a tight delta.",
                    divergence="binary_tv", delta=0.01)(L.dppo)
    assert "trustscope_verl_test_tight_tv" in tv.register_policy_losses()
    assert "trustscope_verl_test_tight_tv" in core_algos.POLICY_LOSS_REGISTRY


@pytest.mark.slow
def test_verl_plugin_entry_point_registers_the_rules(tmp_path):
    """verl loads group ``verl.plugins`` on ``import verl``; the entry point pyproject declares must register the rules.

    The declaration is installed as metadata of a stand-in distribution, so the test reads this checkout's
    pyproject, not whatever trustscope the environment has installed.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["verl.plugins"]
    dist = tmp_path / "trustscope_plugin_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trustscope-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    code = ("import verl\nfrom verl.trainer.ppo import core_algos\n"
            "print(sorted(m for m in core_algos.POLICY_LOSS_REGISTRY if m.startswith('trustscope_')))")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert eval(done.stdout.strip().splitlines()[-1]) == sorted(tv.verl_loss_mode(r) for r in tv.verl_rules())


def test_extra_asks_for_the_verl_releases_this_module_supports():
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"verl{tv.SUPPORTED_VERL}" in project["project"]["optional-dependencies"]["verl"]
    assert verl.__version__ in SpecifierSet(tv.SUPPORTED_VERL)


def test_a_verl_outside_the_range_is_named_at_attach(monkeypatch, tmp_path):
    trainer = local_trainer(ppo_config(), LocalActorGroup(torch.zeros(1, 1)))
    monkeypatch.setattr(verl, "__version__", "0.7.1")
    with pytest.raises(tv.VerlVersionError, match=r"supports verl >=0\.8,<0\.10; the installed verl 0\.7\.1 is older"):
        tv.attach(trainer, tmp_path)
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.warns(UserWarning, match=r"supports verl >=0\.8,<0\.10, this is verl 0\.10\.0"):
        tv.attach(trainer, tmp_path).close()


# ----------------------------------------------------------------------------------------- the loss in verl's actor


@pytest.mark.parametrize("rule", ["dppo_binary_tv", "ppo_clip", "minirl", "cispo", "minimal_negative_mask"])
@pytest.mark.parametrize("agg", [("token-mean", "token_mean"), ("seq-mean-token-sum-norm", "seq_mean_token_sum_norm")])
def test_verl_ppo_loss_equals_the_trustscope_rule(rule, agg, tmp_path):
    """verl's own ppo_loss with loss_mode=trustscope_<rule>: micro-batch losses add up to the rule's mini-batch loss.

    Without the actor hook verl gives the rule old_log_prob as mu, so the reference uses it as mu too; the
    gradients through pi agree as well.
    """
    verl_agg, ts_agg = agg
    batch, pi = make_batch(seed=3)
    stamped(batch, tmp_path)
    pi_verl = pi.clone().requires_grad_(True)
    cfg = actor_config(tv.verl_loss_mode(rule), verl_agg)
    minis = run_actor(batch, pi_verl, lambda **kw: ppo_loss(config=cfg, **kw))
    pi_ref = pi.clone().requires_grad_(True)
    old = batch.batch["old_log_probs"]
    total_ref = 0.0
    for results in minis:
        sids = [s for ids, _, _ in results for s in ids]
        verl_loss = sum(loss for _, loss, _ in results)
        mask = batch.batch["response_mask"][sids].bool()
        out = L.get_loss(rule)(L.PolicyBatch(pi_logprob=pi_ref[sids], mu_logprob=old[sids],
                                             advantages=batch.batch["advantages"][sids], mask=mask,
                                             old_logprob=old[sids]))
        ref = L.aggregate(out.loss, mask, ts_agg)
        assert torch.allclose(verl_loss, ref, atol=1e-6), (verl_loss, ref)
        verl_loss.backward()
        total_ref = total_ref + ref
        blocked = (mask & ~out.keep).float()
        fracs = [m["actor/pg_clipfrac"].aggregate() for _, _, m in results]
        sizes = [int(batch.batch["response_mask"][ids].sum()) for ids, _, _ in results]
        assert sum(f * n for f, n in zip(fracs, sizes, strict=True)) == pytest.approx(float(blocked.sum()))
    total_ref.backward()
    assert torch.allclose(pi_verl.grad, pi_ref.grad, atol=1e-6)
    assert pi_verl.grad.abs().sum() > 0


def _has_agg_mode(mode: str) -> bool:
    try:
        core_algos.agg_loss(loss_mat=torch.zeros(1, 1), loss_mask=torch.ones(1, 1), loss_agg_mode=mode)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not _has_agg_mode("token-sum"), reason="verl before 0.9 has no token-sum aggregation")
def test_policy_loss_applies_rollout_is_weights_like_verl():
    batch, pi = make_batch(seed=5)
    b = batch.batch
    w = torch.rand(pi.shape) + 0.5
    cfg = actor_config("trustscope_pg_is")
    fn = core_algos.get_policy_loss_fn("trustscope_pg_is")
    args = dict(old_log_prob=b["old_log_probs"], log_prob=pi, advantages=b["advantages"],
                response_mask=b["response_mask"], loss_agg_mode="token-sum", config=cfg)
    plain, _ = fn(**args)
    weighted, metrics = fn(**args, rollout_is_weights=w)
    out = L.get_loss("pg_is")(L.PolicyBatch(pi_logprob=pi, mu_logprob=b["old_log_probs"], advantages=b["advantages"],
                                            mask=b["response_mask"].bool()))
    assert torch.allclose(plain, out.loss.sum(), atol=1e-6)
    assert torch.allclose(weighted, (out.loss * w).sum(), atol=1e-6)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("mode", sorted(tv.VERL_MASKS))
def test_replayed_mask_of_verl_loss_matches_verl_clipfrac(mode, tmp_path):
    """For verl's own mask-based losses the hook logs a replay of their mask; verl's own clip metrics agree with it.

    vanilla's gradient-free tokens are its clipped ones (pg_clipfrac) plus its dual-clipped ones
    (pg_clipfrac_lower); DPPO's are 1 - its valid mask (pg_clipfrac).
    """
    batch, pi = make_batch(B=8, seed=13)
    stamped(batch, tmp_path)
    settings = {"vanilla": {"clip_ratio_c": 1.5}, "dppo_tv": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1},
                "dppo_kl": {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02}}[mode]
    cfg = actor_config(mode, **settings)
    hook = tv.ActorLogHook(partial(ppo_loss, config=cfg), tmp_path / "logs", "native", loss_rule=f"verl:{mode}",
                           mask_fn=partial(tv.VERL_MASKS[mode], config=cfg))
    minis = run_actor(batch, pi, hook)
    hook.close()
    tokens = _read(tmp_path / "logs" / "native", "tokens")
    blocked_total = 0
    for results in minis:
        for ids, _, metrics in results:
            rows = tokens[tokens["sample_id"].isin(ids)]
            blocked = float((~rows["kept"]).mean())
            verl_blocked = metrics["actor/pg_clipfrac"].aggregate()
            if mode == "vanilla":
                verl_blocked += metrics["actor/pg_clipfrac_lower"].aggregate()
            assert blocked == pytest.approx(verl_blocked, abs=1e-6), (ids, blocked, verl_blocked)
            blocked_total += int((~rows["kept"]).sum())
    assert blocked_total > 0


# ---------------------------------------------------------------------------------------------- the logging hook


def _read(run_dir: Path, table: str):
    return pq.ParquetDataset(sorted(str(p) for p in (run_dir / table).rglob("*.parquet"))).read().to_pandas()


@pytest.mark.parametrize("max_tokens", [None, 10])
def test_hook_logs_one_run_that_validates_and_joins(max_tokens, tmp_path):
    """Driver rank 0 writes samples, the actor hook rank 1 writes tokens; two epochs of two mini-batches are four
    updates, each logged once with its update_index (each sample twice, once per epoch).

    The hook hands the rule rollout_log_probs as mu; the logged rows carry the driver batch's tensors at the
    stamped sample id, pi from the loss's forward, and the rule's own mask, with fixed micro-batches and with
    verl's dynamic batch size (rows regrouped by length).
    """
    rule = "dppo_binary_tv"
    batch, pi = make_batch(B=8, seed=11)
    entropy = torch.rand(pi.shape) * batch.batch["response_mask"]
    logdir = tmp_path / "logs"
    driver = TokenLogger(logdir, "verl-run", rank=0, loss_rule=rule, source={"framework": "verl",
                                                                             "version": verl.__version__})
    tv.log_driver_batch(driver, batch, step=3)
    cfg = actor_config(tv.verl_loss_mode(rule))
    hook = tv.ActorLogHook(lambda **kw: ppo_loss(config=cfg, **kw), logdir, "verl-run", loss_rule=rule)
    minis = run_actor(batch, pi, hook, epochs=2, entropy=entropy, max_tokens=max_tokens)
    sizes = {len(ids) for results in minis for ids, _, _ in results}
    assert (sizes == {2}) == (max_tokens is None)  # dynamic batch sizes regroup the rows
    driver.log_step(3, scalars=tv.actor_scalars({"actor/pg_clipfrac": [m["actor/pg_clipfrac"].aggregate()
                                                                        for r in minis for _, _, m in r]}))
    driver.close()
    tv.unstamp_batch(batch)
    assert tv.SAMPLE_KEY not in batch.batch and tv.STEP_KEY not in batch.meta_info

    run = logdir / "verl-run"
    assert hook._share_done and hook._logger.manifest["status"] == "running"  # open for the next step
    hook._logger.flush()
    assert S.validate_logdir(logdir) == []
    hook.close()
    assert run_status(run) == "finished"
    assert json.loads((run / "run.json").read_text())["source"]["framework"] == "verl"
    tokens, samples = _read(run, "tokens"), _read(run, "samples")
    assert set(tokens["rank"]) == {1} and set(samples["rank"]) == {0}
    b = batch.batch
    mask = b["response_mask"].bool()
    assert len(tokens) == 2 * int(mask.sum())  # each sample once per update that trained it: once per epoch
    assert sorted(set(tokens["update_index"])) == [0, 1, 2, 3]
    per_sample = tokens.groupby("sample_id")["update_index"].agg(lambda u: sorted(set(u)))
    assert len(per_sample) == 8 and all(len(u) == 2 and u[0] < 2 <= u[1] for u in per_sample)
    assert not tokens.duplicated(["sample_id", "pos", "update_index"]).any()
    out = L.get_loss(rule)(L.PolicyBatch(pi_logprob=pi, mu_logprob=b["rollout_log_probs"], advantages=b["advantages"],
                                         mask=mask, old_logprob=b["old_log_probs"]))
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_array_equal(tokens["token_id"], b["responses"].numpy()[sid, pos])
    np.testing.assert_allclose(tokens["mu_logprob"], b["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["old_logprob"], b["old_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["pi_logprob"], pi.numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["advantage"], b["advantages"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["entropy"], entropy.numpy()[sid, pos], atol=1e-6)
    np.testing.assert_array_equal(tokens["kept"], out.keep.numpy()[sid, pos])
    assert (~tokens["kept"]).any()  # the case exercises the mask
    assert set(tokens["loss_rule"]) == {rule}

    con = duckdb.connect()
    joined = con.execute(
        "select count(*), count(distinct s.prompt_id), bool_and(t.prompt_id = s.prompt_id) "
        "from read_parquet(?) t join read_parquet(?) s using (run_id, step, sample_id)",
        [str(run / "tokens" / "**" / "*.parquet"), str(run / "samples" / "**" / "*.parquet")],
    ).fetchone()
    assert joined == (len(tokens), 4, True)  # every row of every update joins its samples row
    assert sorted(samples["length"]) == sorted(mask.sum(-1).tolist())
    np.testing.assert_allclose(samples.sort_values("sample_id")["reward"], b["token_level_scores"].sum(-1))

    # trustscope's query layer reads it as one run, and its SQL replay of the rule (anchored on the logged mu)
    # blocks exactly the tokens the rule blocked inside verl's loss
    logdb = tdb.connect(logdir, cache=False)
    runs = logdb.sql("select run_id, status, n_samples from runs").to_pandas()
    assert runs.to_dict("records") == [{"run_id": "verl-run", "status": "finished", "n_samples": 8}]
    summary = logdb.sql("select n_tokens, n_samples, trainer_blocked_frac, blocked_frac__dppo_binary_tv "
                        "from step_summary where step = 3").to_pandas().iloc[0]
    assert summary["n_tokens"] == len(tokens) and summary["n_samples"] == 8
    assert summary["trainer_blocked_frac"] == pytest.approx(summary["blocked_frac__dppo_binary_tv"])


def test_turns_come_from_the_gaps_of_the_response_mask():
    """A multi-turn agent loop's response mask is False on the tool's tokens: each gap starts a new turn."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0],   # turns 0, 1, 2, then padding
                         [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],   # single-turn
                         [0, 1, 1, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # a leading masked token
    turns = turns_from_mask(mask.numpy())
    assert turns.dtype == np.int32
    assert turns[mask.numpy()].tolist() == [0, 0, 1, 1, 2] + [0] * 7 + [0, 0, 1, 1, 1, 1, 1, 1]
    first, last = tv.tag_versions([{"min_global_steps": 4, "max_global_steps": 5},
                                   {"min_global_steps": 6, "max_global_steps": 6}], 2)
    assert first.tolist() == [5, 7] and last.tolist() == [6, 7]
    assert tv.tag_versions([{"status": "success"}], 1) is None and tv.tag_versions(None, 0) is None


def test_hook_without_stamp_passes_through(tmp_path):
    calls = []
    hook = tv.ActorLogHook(lambda **kw: calls.append(kw) or ("loss", {}), tmp_path, "r", loss_rule="x")
    assert hook(model_output={}, data=left_right_2_no_padding(make_batch()[0].to_tensordict())) == ("loss", {})
    assert len(calls) == 1 and not (tmp_path / "r").exists()


def test_hook_survives_pickling_without_its_logger(tmp_path):
    import pickle

    batch, pi = make_batch(seed=2)
    stamped(batch, tmp_path)
    cfg = actor_config("trustscope_grpo")
    hook = tv.ActorLogHook(partial(ppo_loss, config=cfg), tmp_path / "logs", "pickled", loss_rule="grpo")
    run_actor(batch, pi, hook, mini=8, micro=4)
    hook.close()
    copy = pickle.loads(pickle.dumps(hook))
    assert copy._logger is None and copy._call is None and copy.run_id == "pickled"


# ------------------------------------------------------------------------------------------------- version drift


def test_moved_internal_names_version_and_attribute(monkeypatch):
    monkeypatch.delattr(core_algos, "register_policy_loss")
    with pytest.raises(tv.VerlVersionError, match=r"verl [0-9.]+: verl\.trainer\.ppo\.core_algos\.register_policy_loss "
                                                  r"is missing"):
        tv.register_policy_losses()


def test_hook_names_a_moved_padding_helper(monkeypatch, tmp_path):
    import verl.workers.utils.padding as padding

    batch, pi = make_batch(seed=4)
    stamped(batch, tmp_path)
    hook = tv.ActorLogHook(partial(ppo_loss, config=actor_config("trustscope_grpo")), tmp_path / "logs", "moved",
                           loss_rule="grpo")
    monkeypatch.delattr(padding, "no_padding_2_padding")
    with pytest.raises(tv.VerlVersionError, match=r"verl [0-9.]+: verl\.workers\.utils\.padding\."
                                                  r"no_padding_2_padding is missing"):
        run_actor(batch, pi, hook)
    assert not (tmp_path / "logs" / "moved" / "tokens").exists()


def test_trainer_without_update_actor_is_refused(tmp_path):
    class OldTrainer:
        config = OmegaConf.create({})
        global_steps = 0
        actor_rollout_wg = object()

    with pytest.raises(tv.VerlVersionError, match=r"verl [0-9.]+: trainer OldTrainer has no _update_actor"):
        tv.attach(OldTrainer(), tmp_path)


# ----------------------------------------------------------------------------------------------- Ray, end to end


def train_mini_batch(loss_fn, data, pi: torch.Tensor, rank: int = 0, world: int = 1):
    """An actor's ``update_actor`` as ``TrainingWorker.train_mini_batch`` and the engine's ``forward_backward_batch``
    run it in verl 0.9.1, the model's forward replaced by ``pi``; returns verl's metrics TensorDict."""
    mini_batch_size = tu.pop(data, key="mini_batch_size") // world
    epochs, seed = tu.pop(data, key="epochs"), tu.pop(data, key="seed")
    loader = tu.make_iterator(data, mini_batch_size=mini_batch_size, epochs=epochs, seed=seed + rank,
                              dataloader_kwargs=tu.pop(data, key="dataloader_kwargs"))
    clipfrac = []
    for mini_td in loader:
        tu.assign_non_tensor(mini_td, batch_num_tokens=int(mini_td["loss_mask"].sum()) * world, dp_size=world,
                             use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
        for mb in prepare_micro_batches(mini_td)[0]:
            _, metrics = loss_fn(model_output=model_output(mb, pi), data=mb, dp_group=None)
            if "actor/pg_clipfrac" in metrics:  # verl's losses without a mask report none
                clipfrac.append(metrics["actor/pg_clipfrac"].aggregate())
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"pg_clipfrac": clipfrac, "mfu": 0.0}})


class LocalActorGroup:
    """One actor in this process behind the two worker-group methods the trainer and attach call."""

    def __init__(self, pi: torch.Tensor):
        self.pi, self.loss_fn = pi, None

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def update_actor(self, data):
        return train_mini_batch(self.loss_fn, data, self.pi)


def ppo_config(**overrides):
    """verl's full default PPO config (its generated yaml), small batches, ``overrides`` as dotted keys."""
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    settings = {
        "actor_rollout_ref.actor.policy_loss.loss_mode": "trustscope_dppo_binary_tv",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        **overrides,
    }
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def local_trainer(cfg, group):
    """A ``RayPPOTrainer`` with verl's own ``_update_actor``, built without starting workers."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.tokenizer, trainer.global_steps, trainer.actor_rollout_wg = cfg, None, 1, group
    return trainer


@pytest.mark.parametrize("case", ["rule", "no_rollout_logprobs", "verl_loss", "verl_loss_unreplayed", "bypass"])
def test_attach_records_what_verl_keeps(case, tmp_path):
    """What attach logs depends on verl's settings; each departure from the full picture is warned and recorded."""
    overrides = {
        "rule": {},
        "no_rollout_logprobs": {"actor_rollout_ref.rollout.calculate_log_probs": False},
        "verl_loss": {"actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla"},
        "verl_loss_unreplayed": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gpg"},
        "bypass": {"algorithm.rollout_correction.bypass_mode": True},
    }[case]
    batch, pi = make_batch(B=8, seed=31)
    if case == "no_rollout_logprobs":
        del batch.batch["rollout_log_probs"]
    if case == "bypass":
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # verl's apply_bypass_mode
    trainer = local_trainer(ppo_config(**overrides), LocalActorGroup(pi))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tv.attach(trainer, tmp_path, run_id=case):
            trainer._update_actor(batch)
    messages = " ".join(str(w.message) for w in caught)
    run = tmp_path / case
    assert S.validate_logdir(tmp_path) == [] and run_status(run) == "finished"
    manifest = json.loads((run / "run.json").read_text())
    tokens = _read(run, "tokens")
    b = batch.batch
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    if case == "no_rollout_logprobs":
        assert "calculate_log_probs" in messages and manifest["mu_source"] == "trainer_recompute"
        np.testing.assert_allclose(tokens["mu_logprob"], b["old_log_probs"].numpy()[sid, pos], atol=1e-6)
    else:
        assert manifest["mu_source"] == "engine"
        np.testing.assert_allclose(tokens["mu_logprob"], b["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    if case == "verl_loss":
        assert manifest["loss_rule"] == "verl:vanilla" and not tokens["kept"].all()
        assert manifest["config"]["verl"]["kept"] == "verl's vanilla mask, replayed"
    elif case == "verl_loss_unreplayed":
        assert "verl's own" in messages and manifest["loss_rule"] == "verl:gpg" and tokens["kept"].all()
    else:
        assert manifest["loss_rule"] == "dppo_binary_tv" and not tokens["kept"].all()
    assert tokens["old_logprob"].isna().all() == (case == "bypass")
    assert manifest["config"]["verl"]["bypass_mode"] == (case == "bypass")
    assert tv.SAMPLE_KEY not in b and tv.STEP_KEY not in batch.meta_info



def test_attach_adds_the_step_summaries_to_verls_step_metrics(tmp_path):
    """The actor update's metrics, which verl's ``reduce_metrics`` hands its ``Tracking`` logger, carry a step's
    exact summaries over the actors' tokens as ``trustscope/...`` once every actor rank committed it: at the next
    update, named by ``trustscope/step`` (the driver never waits); a malformed webhook fails at attach."""
    from verl.utils.metric import reduce_metrics

    from trustscope.trackers import committed_step_rows, step_metrics

    batch, pi = make_batch(B=8, seed=7)
    trainer = local_trainer(ppo_config(), LocalActorGroup(pi))
    with pytest.raises(ValueError, match="webhook url 'slack' must start with http"):
        tv.attach(trainer, tmp_path, run_id="bad", webhook="slack")
    with tv.attach(trainer, tmp_path, run_id="m") as run:
        first = trainer._update_actor(batch)
        assert not [k for k in first.meta_info["metrics"] if k.startswith("trustscope/")]  # nothing waited for
        for _ in range(50):  # the actor's writer thread commits step 1 on its own time
            if run.actors_committed(1):
                break
            time.sleep(0.1)
        trainer.global_steps = 2
        output = trainer._update_actor(batch)
    metrics = reduce_metrics(dict(output.meta_info["metrics"]))
    want = step_metrics(committed_step_rows(tmp_path / "m", 1, ranks=[1]), 1)
    # two epochs of two mini-batches: every token once per epoch
    assert want["trustscope/tokens/total"] == 2 * int(batch.batch["response_mask"].sum())
    assert metrics["trustscope/step"] == 1 and {k: metrics[k] for k in want} == pytest.approx(want, nan_ok=True)
    assert metrics["trustscope/warning"] == 0 and "actor/pg_clipfrac" in metrics
    trainer.global_steps = 1
    with tv.attach(trainer, tmp_path, run_id="off", metrics=False):
        output = trainer._update_actor(batch)
    assert not [k for k in output.meta_info["metrics"] if k.startswith("trustscope/")]
    assert "trustscope/warning/bad_rate_z" not in metrics  # the absolute lines by default
    with pytest.raises(ValueError, match=r"WarningLines.relative_z=-1 must be a finite number > 0"):
        tv.attach(trainer, tmp_path, run_id="bad-z", warn_relative=-1)
    with tv.attach(trainer, tmp_path, run_id="relative", warn_relative=6) as run:
        trainer._update_actor(batch)
        for _ in range(50):
            if run.actors_committed(1):
                break
            time.sleep(0.1)
        trainer.global_steps = 2
        output = trainer._update_actor(batch)
    metrics = reduce_metrics(dict(output.meta_info["metrics"]))
    assert {"trustscope/warning", "trustscope/warning/bad_rate_z", "trustscope/warning/mismatch_z"} <= set(metrics)


class ToyActor(Worker):
    """A verl ``Worker`` that trains like ``ActorRolloutRefWorker.update_actor`` with the model's forward replaced.

    ``set_loss_fn`` (ONE_TO_ALL) and ``update_actor`` taking a TensorDict are the two worker methods the trainer
    and :func:`attach` call; the body follows ``TrainingWorker.train_mini_batch`` and the engine's
    ``forward_backward_batch``. It lives at module level, as verl's own workers do, so Ray pickles it by
    reference: a class pickled by value would carry the driver's copy of verl's TransferQueue globals
    (``TQ_INITIALIZED`` from an earlier test) into the worker, which then never connects its own client.
    """

    def __init__(self, pi):
        super().__init__()
        self.pi, self.loss_fn = pi, None
        self._register_dispatch_collect_info(mesh_name="actor", dp_rank=self.rank, is_collect=self.rank == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data):
        output = train_mini_batch(self.loss_fn, data, self.pi, self.rank, self.world_size)
        return output if self.rank == 0 else None


def _ray_actor_class():
    """:class:`ToyActor` as a Ray actor class."""
    import ray

    return ray.remote(ToyActor)


@pytest.mark.slow
def test_attach_logs_a_trainer_with_ray_actor_workers(tmp_path):
    """``attach`` on a real ``RayPPOTrainer`` (its own ``_update_actor``) with two actor workers in local Ray.

    The hook travels to the workers through verl's ``set_loss_fn``, each worker logs its half of the tokens as its
    own rank, the driver logs samples and verl's actor metrics, and the whole is one valid, finished run.
    """
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    batch, pi = make_batch(B=8, seed=21)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    try:
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, device_name="cpu",
                               ray_cls_with_init=RayClassWithInitArgs(_ray_actor_class(), pi=pi))
        trainer = local_trainer(ppo_config(), group)
        with tv.attach(trainer, tmp_path, run_id="ray-run") as run:
            output = trainer._update_actor(batch)
        assert trainer._update_actor.__func__ is RayPPOTrainer._update_actor  # restored on close
    finally:
        ray.shutdown()
    assert run.run_id == "ray-run" and "actor/pg_clipfrac" in output.meta_info["metrics"]
    run_dir = tmp_path / "ray-run"
    assert S.validate_logdir(tmp_path) == []
    assert run_status(run_dir) == "finished"
    tokens, samples, steps = _read(run_dir, "tokens"), _read(run_dir, "samples"), _read(run_dir, "steps")
    assert sorted(set(tokens["rank"])) == [1, 2] and set(samples["rank"]) == {0}
    assert tokens.groupby("rank")["sample_id"].nunique().tolist() == [4, 4]
    assert len(tokens) == 2 * int(batch.batch["response_mask"].sum())  # ppo_epochs=2: each token once per epoch
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_allclose(tokens["mu_logprob"], batch.batch["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["pi_logprob"], pi.numpy()[sid, pos], atol=1e-6)
    assert "actor/pg_clipfrac" in set(steps["name"])
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["loss_rule"] == "dppo_binary_tv" and manifest["mu_source"] == "engine"
    assert manifest["config"]["verl"]["loss_mode"] == "trustscope_dppo_binary_tv"


def test_attach_before_init_workers_says_so(tmp_path):
    trainer = local_trainer(ppo_config(), LocalActorGroup(torch.zeros(1, 1)))
    del trainer.actor_rollout_wg
    with pytest.raises(RuntimeError, match=r"call trainer.init_workers\(\) first"):
        tv.attach(trainer, tmp_path)
    assert not any(tmp_path.iterdir())


def test_another_update_actor_is_refused_with_advice(tmp_path):
    class PPOTrainer:  # neither RayPPOTrainer's _update_actor(batch) nor the V1 trainer's (batch, metrics)
        config, global_steps, actor_rollout_wg = ppo_config(), 1, LocalActorGroup(torch.zeros(1, 1))

        def _update_actor(self, batch, metrics, extra):
            raise AssertionError("not called")

    with pytest.raises(NotImplementedError, match=r"neither .*trainer\.use_v1=False"):
        tv.attach(PPOTrainer(), tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(__import__("importlib").util.find_spec("verl.trainer.ppo.v1") is None,
                    reason="verl before 0.9 has no V1 trainer")
def test_verl_v1_trainer_without_transfer_queue_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.config, trainer.global_steps, trainer.actor_rollout_wg = ppo_config(), 1, LocalActorGroup(torch.zeros(1))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transfer_queue"
                        else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"transferqueue==0\.1\.11.*trainer\.use_v1=False"):
        tv.attach(trainer, tmp_path)
    assert not any(tmp_path.iterdir())


def _v1_keys(batch) -> list[str]:
    """TransferQueue keys as verl's V1 agent loop names trajectories: ``{uid}_{session}_{index}``."""
    return [f"{uid}_0_{i}" for i, uid in enumerate(batch.non_tensor_batch["uid"])]


def _v1_rows(batch):
    """The batch's rows as verl's V1 agent loop puts them into TransferQueue: one unpadded tensor per sample and
    field (``AgentLoopWorkerTQ``: prompts, responses, input_ids, an all-ones attention_mask, position_ids; the
    per-response fields as long as the response)."""
    from tensordict import TensorDict

    b = batch.batch
    P = b["prompts"].shape[1]
    per_sample: dict[str, list] = {}
    for i in range(len(batch)):
        prompt = b["prompts"][i][b["attention_mask"][i, :P].bool()]
        r = int(b["response_mask"][i].sum())
        response = b["responses"][i, :r]
        row = {"prompts": prompt, "responses": response, "input_ids": torch.cat([prompt, response]),
               "attention_mask": torch.ones(len(prompt) + r, dtype=torch.int64),
               "position_ids": torch.arange(len(prompt) + r), "response_mask": b["response_mask"][i, :r],
               "loss_mask": b["response_mask"][i, :r]}
        for key in ("old_log_probs", "rollout_log_probs", "advantages", "token_level_scores"):
            row[key] = b[key][i, :r]
        for key, value in row.items():
            per_sample.setdefault(key, []).append(value)
    return TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in per_sample.items()},
                      batch_size=[len(batch)])


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("verl.trainer.ppo.v1") is None,
                    reason="verl before 0.9 has no V1 trainer")
def test_attach_logs_verls_v1_trainer_through_transfer_queue(tmp_path):
    """``attach`` on verl's V1 trainer (``trainer.use_v1=True``, the default): its own ``_update_actor(batch,
    metrics)`` with a real TransferQueue in local Ray and two actor workers that fetch their rows from it.

    The same guarantees as the V0 path: one valid, finished run; each actor's tokens as its own rank, joined to the
    driver's samples by the sample id the driver wrote into TransferQueue; mu from ``rollout_log_probs``; the
    applied mask (the rule's) against verl's own ``pg_clipfrac``.
    """
    import ray
    import transfer_queue as tq
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    batch, pi = make_batch(B=8, seed=23)
    cfg = ppo_config(**{"transfer_queue.enable": True,
                        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1})
    fields = _v1_rows(batch)
    # logical CPUs: TransferQueue's controller and its storage unit hold one each, beside the two actors' bundles
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    try:
        tq.init(cfg.transfer_queue)
        # an asynchronous step 3: each trajectory started under weights 0, 1 or 2 (verl's numbering)
        meta = tq.kv_batch_put(keys=_v1_keys(batch), partition_id="train", fields=fields,
                               tags=[{"status": "success", "min_global_steps": i % 3, "max_global_steps": 2}
                                     for i in range(8)])
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, device_name="cpu",
                               ray_cls_with_init=RayClassWithInitArgs(_ray_actor_class(), pi=pi))
        trainer = object.__new__(PPOTrainerSync)
        trainer.config, trainer.tokenizer, trainer.global_steps, trainer.actor_rollout_wg = cfg, None, 3, group
        trainer.parameter_sync_step, trainer.local_trigger_step = 1, 0  # as verl's __init__ sets them: one update
        metrics: dict = {"training/off_policy/evicted_samples": 2.0, "training/num_turns/mean": 1.0}
        with tv.attach(trainer, tmp_path, run_id="v1-run") as run:
            out = trainer._update_actor(meta, metrics)
        assert trainer._update_actor.__func__ is PPOTrainer._update_actor  # restored on close
        assert out is meta and tv.STEP_KEY not in meta.extra_info and tv.SAMPLE_KEY not in meta.fields
        assert tv.VERSION_KEY not in meta.fields
        stamped = tq.kv_batch_get(keys=meta.keys, partition_id="train", select_fields=[tv.SAMPLE_KEY])
    finally:
        tq.close()
        ray.shutdown()
    assert isinstance(run, tv.VerlV1Logging) and stamped[tv.SAMPLE_KEY].tolist() == list(range(8))
    run_dir = tmp_path / "v1-run"
    assert S.validate_logdir(tmp_path) == [] and run_status(run_dir) == "finished"
    tokens, samples, steps = _read(run_dir, "tokens"), _read(run_dir, "samples"), _read(run_dir, "steps")
    assert sorted(set(tokens["rank"])) == [1, 2] and set(samples["rank"]) == {0}
    assert tokens.groupby("rank")["sample_id"].nunique().tolist() == [4, 4]
    b = batch.batch
    assert len(tokens) == 2 * int(b["response_mask"].sum())  # ppo_epochs=2: each token once per epoch
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_allclose(tokens["mu_logprob"], b["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["old_logprob"], b["old_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_allclose(tokens["pi_logprob"], pi.numpy()[sid, pos], atol=1e-6)
    # the driver's samples rows from TransferQueue: lengths, rewards, and prompt groups from the keys' uids
    samples = samples.sort_values("sample_id")
    assert samples["sample_id"].tolist() == list(range(8))
    assert samples["length"].tolist() == b["response_mask"].sum(-1).tolist()
    np.testing.assert_allclose(samples["reward"], b["token_level_scores"].sum(-1).numpy(), atol=1e-6)
    assert samples["prompt_id"].nunique() == 4 and samples.groupby("prompt_id").size().tolist() == [2, 2, 2, 2]
    # the mask the rule applied, against verl's pg_clipfrac as the V1 trainer reduced it into the step's metrics
    assert 0 < metrics["actor/pg_clipfrac"] < 1 and "actor/pg_clipfrac" in set(steps["name"])
    logged = dict(zip(steps["name"], steps["value"], strict=True))
    assert logged["actor/pg_clipfrac"] == pytest.approx(metrics["actor/pg_clipfrac"])
    assert not tokens["kept"].all()
    # each response's version from its trajectory's first weights: staleness = verl's trajectory_staleness_worst
    assert (tokens["policy_version"] == tokens["sample_id"] % 3 + 1).all()
    assert (tokens["step"] - tokens["policy_version"] == 2 - tokens["sample_id"] % 3).all()
    assert (tokens["turn"] == 0).all()  # single-turn responses: no gap in the response mask
    assert logged["training/off_policy/evicted_samples"] == 2.0 and "training/num_turns/mean" not in logged
    assert (tokens["policy_version_last"] == 3).all()  # and the last, from max_global_steps
    # the step's summaries need every actor's commit: published at a later update, never waited for here
    assert not [k for k in metrics if k.startswith("trustscope/")]
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["loss_rule"] == "dppo_binary_tv" and manifest["mu_source"] == "engine"


@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_with_each_step_once(tmp_path):
    """SIGKILL inside step 3's actor update (the checkpoint is step 2's), then attach(resume=True) at step 3 as
    verl resumes: every rank holds each step once, as many rows per step as an uninterrupted run."""
    script = Path(__file__).parent / "verl_kill_resume.py"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}"}

    def run(logdir: Path, mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(logdir), mode], env=env, capture_output=True,
                              text=True, timeout=300)

    killed = run(tmp_path / "a", "kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "a" / "killed"
    assert json.loads((run_dir / "ranks" / "rank0001.json").read_text())["last_step"] >= 2
    resumed = run(tmp_path / "a", "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert run(tmp_path / "b", "whole").returncode == 0

    def per_step(run: Path) -> dict:
        con = duckdb.connect()
        out = {}
        for table in ("tokens", "samples", "steps"):
            files = [str(p) for p in S.committed_files(run)[table]]
            for rank, step, n in con.execute("select rank, step, count(*) from read_parquet(?) group by all",
                                             [files]).fetchall():
                out[table, rank, step] = n
        return out

    got = per_step(run_dir)
    assert got == per_step(tmp_path / "b" / "killed")
    assert sorted({k[2] for k in got if k[0] == "tokens"}) == [1, 2, 3, 4]
    assert S.validate_run(run_dir) == [] and run_status(run_dir) == "finished"
    # a checkpoint newer than the log does not stop the job: a logging incident naming the rank and the steps
    trainer = local_trainer(ppo_config(), LocalActorGroup(make_batch(B=8)[1]))
    trainer.global_steps = 9
    handle = tv.attach(trainer, tmp_path / "a", run_id="killed", resume=True)
    with pytest.warns(LogWarning, match=r"resumed after step 8, but rank 0 logged only up to step 4: steps 5-8"):
        trainer._update_actor(make_batch(B=8)[0])
    handle.close()
    assert any("logging incident resume_log_short" in p.message for p in S.validate_run(run_dir))


# ----------------------------------------------------- verl's own worker, engine and model forward, sharded actors


def _torchrun_env() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def _engine_run(tmp_path: Path, world: int, sp: int, timeout: int = 600) -> Path:
    """Driver batch and tiny Qwen2 under ``tmp_path``; then ``torchrun`` of ``world`` verl actor processes
    (tests/verl_engine_run.py: verl's ``TrainingWorker.train_mini_batch`` over its FSDP engine, Ulysses sequence
    size ``sp``) on gloo, with the hook as their loss function. Returns the run directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trustscope.train.toy import toy_tokenizer

    tok = toy_tokenizer()
    model_dir = tmp_path / "model"
    if not model_dir.exists():  # random weights, spread so that log-probs differ from token to token
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          tie_word_embeddings=False, initializer_range=0.5, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    batch, _ = make_batch(B=8, P=6, T=8, seed=5)
    batch.batch["prompts"] = batch.batch["prompts"] % (len(tok) - 4) + 4 * batch.batch["attention_mask"][:, :6]
    batch.batch["responses"] = batch.batch["responses"] % (len(tok) - 4) + 4 * batch.batch["response_mask"]
    batch.batch["input_ids"] = torch.cat([batch.batch["prompts"], batch.batch["responses"]], 1)
    out = tmp_path / f"world{world}-sp{sp}"
    out.mkdir()
    logdir = out / "logs"
    with TokenLogger(logdir, "sharded", rank=0, loss_rule="dppo_binary_tv") as driver:
        tv.log_driver_batch(driver, batch, step=1, updates=tv.updates_of_call(8, 4, 1))  # 2 mini-batches, 1 epoch
    td = left_right_2_no_padding(batch.to_tensordict())  # RayPPOTrainer._update_actor's conversion and settings
    tu.assign_non_tensor(td, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=4, mini_batch_size=4, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    torch.save(td, out / "batch.pt")
    cfg = actor_config("trustscope_dppo_binary_tv")
    torch.save(tv.ActorLogHook(partial(ppo_loss, config=cfg), logdir, "sharded", loss_rule="dppo_binary_tv"),
               out / "hook.pt")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"sp": sp, "model": str(model_dir), "batch": str(out / "batch.pt"),
                                "loss_fn": str(out / "hook.pt")}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           str(ROOT / "tests" / "verl_engine_run.py"), str(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=_torchrun_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return logdir / "sharded"


def _hf_logprobs(model_dir: Path, td, sample_ids: list[int]) -> dict[int, np.ndarray]:
    """The tiny model's own log-probs of each response token of ``sample_ids``, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    out = {}
    with torch.no_grad():
        for i, sid in enumerate(td[tv.SAMPLE_KEY].tolist()):
            if sid in sample_ids:
                ids = td["input_ids"][i].unsqueeze(0)  # (1, L) nested row: prompt + response, unpadded
                n = int(td["response_mask"][i].sum())
                logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                out[sid] = logp[-n:].numpy()
    return out


@pytest.mark.slow
def test_ulysses_sequence_parallel_actors_log_what_an_unsharded_run_logs(tmp_path):
    """verl's real actor path on CPU: ``TrainingWorker.train_mini_batch``, its FSDP engine's
    ``forward_backward_batch``, the tiny model's forward and verl's ``ppo_loss`` under the hook, on gloo.

    4 processes as 2 data x 2 Ulysses sequence ranks (verl's own ``(dp, sp)`` device mesh, its Ulysses slicing,
    all-to-all and gather) log one row per token, once per data-parallel replica, as ranks 1 and 2 (data rank + 1),
    the same rows as 2 unsharded data-parallel processes given the same batch; pi is the model's own log-prob.
    """
    sharded = _engine_run(tmp_path, world=4, sp=2)
    plain = _engine_run(tmp_path, world=2, sp=1)
    for run_dir in (sharded, plain):
        assert S.validate_logdir(run_dir.parent) == [] and run_status(run_dir) == "finished"
    a = _read(sharded, "tokens").sort_values(["rank", "sample_id", "pos"]).reset_index(drop=True)
    b = _read(plain, "tokens").sort_values(["rank", "sample_id", "pos"]).reset_index(drop=True)
    td = torch.load(tmp_path / "world2-sp1" / "batch.pt", weights_only=False)
    assert len(a) == len(b) == _read(plain, "samples")["length"].sum()
    assert sorted(set(a["rank"])) == [1, 2] and not a.duplicated(["sample_id", "pos"]).any()
    exact = ["rank", "sample_id", "pos", "token_id", "mu_logprob", "old_logprob", "advantage", "prompt_id",
             "update_index"]
    assert a[exact].equals(b[exact])
    # verl's own train_mini_batch loop: replica r's rows 4r, 4r+1 are its update 0, rows 4r+2, 4r+3 its update 1
    assert a.groupby("sample_id")["update_index"].first().to_dict() == {s: (s % 4) // 2 for s in range(8)}
    np.testing.assert_allclose(a["pi_logprob"], b["pi_logprob"], atol=1e-5)
    np.testing.assert_allclose(a["entropy"], b["entropy"], atol=1e-5)
    assert (a["kept"] == b["kept"]).all()
    assert a["pi_logprob"].std() > 0.1  # log-probs that differ token to token: the comparison can fail
    # the first mini-batch of each replica is trained before any optimizer step: pi is the model's own log-prob
    first = {1: [0, 1], 2: [4, 5]}  # verl's dispatch: replica r gets rows 4r..4r+3, mini-batches of 2 in order
    want = _hf_logprobs(tmp_path / "model", td, [s for ids in first.values() for s in ids])
    for sid, logp in want.items():
        got = a[a["sample_id"] == sid].sort_values("pos")["pi_logprob"].to_numpy()
        np.testing.assert_allclose(got, logp, atol=1e-4)


@pytest.mark.slow
def test_megatron_parallel_state_maps_to_one_logger_per_data_parallel_replica(tmp_path):
    """Megatron's own parallel state (``megatron.core.parallel_state``, what verl's Megatron engine initialises) on
    8 gloo processes, in three layouts of 2 data-parallel replicas: tensor x pipeline, tensor x context, pipeline x
    context. :func:`actor_layout` finds one logging rank per replica (tensor rank 0, context rank 0, last pipeline
    stage), the data-parallel rank from mpu, and refuses a loss group that is not mpu's data-parallel group.
    (verl's Megatron engine itself needs CUDA: it does not run here.)"""
    pytest.importorskip("megatron.core.parallel_state")
    layouts = [[2, 2, 1], [2, 1, 2], [1, 2, 2]]
    (tmp_path / "spec.json").write_text(json.dumps({"layouts": layouts, "out": str(tmp_path)}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                           str(ROOT / "tests" / "verl_engine_run.py"), str(tmp_path / "spec.json"), "megatron"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=_torchrun_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [row for rank in range(8) for row in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    for tp, pp, cp in layouts:
        ranks = [r for r in rows if r["layout"] == [tp, pp, cp]]
        assert {r["name"] for r in ranks} == {f"Megatron: 2 data x {tp} tensor x {pp} pipeline x {cp} context"}
        loggers = [r for r in ranks if r["logs"]]
        assert sorted(r["dp_rank"] for r in loggers) == [0, 1]
        assert all(r["tp"] == 0 and r["cp"] == 0 and r["last_stage"] for r in loggers)
        assert all(r["dp_size"] == 2 for r in ranks)
        assert all("not Megatron's" in r["refused"] and "trustscope maps" in r["refused"] for r in ranks)


@pytest.mark.parametrize(("overrides", "refused"), [
    ({"actor_rollout_ref.actor.strategy": "veomni", "actor_rollout_ref.actor.veomni": {"ulysses_parallel_size": 2}},
     r"strategy veomni with \{'ulysses_parallel_size': 2\}"),
    ({"actor_rollout_ref.actor.strategy": "megatron",
      "actor_rollout_ref.actor.megatron": {"tensor_model_parallel_size": 2, "dynamic_context_parallel": True}},
     r"megatron with dynamic_context_parallel=True"),
])
def test_attach_refuses_a_parallel_layout_it_cannot_map(overrides, refused, tmp_path):
    trainer = local_trainer(ppo_config(**overrides), LocalActorGroup(torch.zeros(1, 1)))
    with pytest.raises(tv.VerlLayoutError, match=refused + r".*trustscope maps FSDP .* Ulysses .* Megatron"):
        tv.attach(trainer, tmp_path)
    assert not any(tmp_path.iterdir())


def test_attach_records_the_actor_layout(tmp_path):
    cfg = ppo_config(**{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2})
    with tv.attach(local_trainer(cfg, LocalActorGroup(torch.zeros(1, 1))), tmp_path, run_id="sp") as run:
        pass
    summary = json.loads((tmp_path / run.run_id / "run.json").read_text())["config"]["verl"]
    assert summary["actor_layout"] == "fsdp: data x 2 Ulysses sequence"


def test_hook_refuses_a_world_it_cannot_map_before_logging(monkeypatch, tmp_path):
    """A world larger than data x Ulysses sequence (ranks in groups trustscope cannot see) stops the first
    micro-batch, naming the layout, with nothing logged."""
    import torch.distributed as dist
    import verl.utils.ulysses as ulysses

    batch, pi = make_batch(seed=6)
    stamped(batch, tmp_path)
    hook = tv.ActorLogHook(partial(ppo_loss, config=actor_config("trustscope_grpo")), tmp_path / "logs", "unmapped",
                           loss_rule="grpo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_world_size", lambda group=None: 2)
        with pytest.raises(tv.VerlLayoutError, match=r"FSDP: 1 data x 2 Ulysses sequence does not make up its world of 1 ranks"):
            run_actor(batch, pi, hook)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "logs" / "unmapped").exists()


def with_routed_experts(batch: DataProto, layers: int, top_k: int, experts: int) -> torch.Tensor:
    """Put R3's ``routed_experts`` into ``batch`` as verl's agent loop lays them out: ``(B, P + T, L, k)`` int16,
    each real position's own experts (a function of its column, so a row off shows), zeros elsewhere."""
    b = batch.batch
    routed = torch.zeros((*b["input_ids"].shape, layers, top_k), dtype=torch.int16)
    col = torch.arange(b["input_ids"].shape[1])
    ids = ((col[:, None, None] + 3 * torch.arange(layers)[:, None] + torch.arange(top_k)) % experts).to(torch.int16)
    for i in range(len(routed)):
        real = b["attention_mask"][i].bool()
        routed[i, real] = ids[real]
    b["routed_experts"] = routed
    return routed


def test_rollout_routed_experts_are_logged_at_the_position_predicting_each_token(tmp_path):
    """R3: verl's batch carries the engine's experts of every position fed (``routed_experts``, laid out like
    ``input_ids`` from the first real prompt token on, zeros elsewhere, as verl's agent loop writes them); the hook
    logs the row that predicts each response token as ``engine_experts``, one off shows."""
    layers, top_k, experts = 2, 2, 8
    batch, pi = make_batch(B=8, seed=5)
    routed = with_routed_experts(batch, layers, top_k, experts)
    p = batch.batch["prompts"].shape[1]
    logdir, shape = tmp_path / "logs", (layers, top_k, experts)
    driver = TokenLogger(logdir, "r3", rank=0, loss_rule="dppo_binary_tv", routing_shape=shape)
    tv.log_driver_batch(driver, batch, step=1)
    cfg = actor_config(tv.verl_loss_mode("dppo_binary_tv"))
    hook = tv.ActorLogHook(lambda **kw: ppo_loss(config=cfg, **kw), logdir, "r3", loss_rule="dppo_binary_tv",
                           logger_options={"routing_shape": shape})
    run_actor(batch, pi, hook)
    driver.close()
    hook.close()
    tokens = _read(logdir / "r3", "tokens")
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    got = np.stack(tokens["engine_experts"].to_list())
    np.testing.assert_array_equal(got, routed.numpy()[sid, p - 1 + pos].reshape(len(tokens), -1))
    assert not np.array_equal(got, routed.numpy()[sid, p + pos].reshape(len(tokens), -1))
    assert tokens["trainer_experts"].isna().all() and tokens["routing_agreement"].isna().all()
    assert json.loads((logdir / "r3" / "run.json").read_text())["routing_shape"] == [2, 2, 8]


def test_r3_routing_shape_comes_from_the_models_config(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path / "moe")
    assert tv.r3_routing_shape(tmp_path / "moe") == (3, 2, 8)
    with pytest.warns(UserWarning, match="cannot be read .* routed experts are not logged"):
        assert tv.r3_routing_shape(tmp_path / "absent") is None


def test_attach_logs_r3_routed_experts_through_verls_own_update(tmp_path):
    """attach on a trainer with rollout routing replay: routing_shape from the model's config in run.json, and
    the batch's routed experts through verl's own ``_update_actor`` conversion land at each response token."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path / "moe")
    batch, pi = make_batch(B=8, seed=31)
    routed = with_routed_experts(batch, 2, 2, 8)
    p = batch.batch["prompts"].shape[1]
    cfg = ppo_config(**{"actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
                        "actor_rollout_ref.model.path": str(tmp_path / "moe")})
    trainer = local_trainer(cfg, LocalActorGroup(pi))
    with tv.attach(trainer, tmp_path / "logs", run_id="r3"):
        trainer._update_actor(batch)
    run = tmp_path / "logs" / "r3"
    assert json.loads((run / "run.json").read_text())["routing_shape"] == [2, 2, 8]
    tokens = _read(run, "tokens")
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_array_equal(np.stack(tokens["engine_experts"].to_list()),
                                  routed.numpy()[sid, p - 1 + pos].reshape(len(tokens), -1))
