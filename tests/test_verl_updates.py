"""Several updates a step through verl's own V1 loop: ``PPOTrainer.step`` with ``parameter_sync_step=4``, two PPO
epochs, rollout rejection sampling and IS weights, TransferQueue and two actor workers in local Ray.

verl's own ``step`` loop, ``_step_once``, ``_compute_advantage`` (its rollout correction: the rejection mask and
IS weights, GRPO advantages) and ``_update_actor`` run; the replay buffer, the reward, the batch balancing and the
old-log-prob recompute (a model's forward) are stand-ins that hand back what is already in TransferQueue, and each
actor's forward is replaced by fixed log-probs (``tests/test_integration_verl.py``'s toy actor).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from test_integration_verl import (
    ROOT,
    LocalActorGroup,
    _ray_actor_class,
    _read,
    actor_config,
    local_trainer,
    make_batch,
    ppo_config,
    run_actor,
)
from verl.workers.utils.losses import ppo_loss

from trustscope import runformat as S
from trustscope.integrations import verl as tv
from trustscope.logger import run_status

B, T, TRIGGERS = 16, 6, 4


def _tq_rows(batch, rows: list[int]):
    """Rows of ``batch`` as verl's V1 agent loop puts them into TransferQueue (unpadded, one tensor per field)."""
    from tensordict import NonTensorStack, TensorDict

    b = batch.batch
    P = b["prompts"].shape[1]
    per: dict[str, list] = {}
    for i in rows:
        prompt = b["prompts"][i][b["attention_mask"][i, :P].bool()]
        r = int(b["response_mask"][i].sum())
        row = {"prompts": prompt, "responses": b["responses"][i, :r], "input_ids": torch.cat([prompt, b["responses"][i, :r]]),
               "attention_mask": torch.ones(len(prompt) + r, dtype=torch.int64),
               "position_ids": torch.arange(len(prompt) + r), "response_mask": b["response_mask"][i, :r],
               "loss_mask": b["response_mask"][i, :r], "old_log_probs": b["old_log_probs"][i, :r],
               "rollout_log_probs": b["rollout_log_probs"][i, :r], "rm_scores": b["token_level_scores"][i, :r]}
        for key, value in row.items():
            per.setdefault(key, []).append(value)
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in per.items()},
                    batch_size=[len(rows)])
    td["uid"] = NonTensorStack(*[str(batch.non_tensor_batch["uid"][i]) for i in rows])
    return td


class _Buffer:
    """The replay buffer's ``sample``: trigger t of the step gets rows 4t .. 4t + 3 (two prompts x n = 2)."""

    def __init__(self, batch):
        self.batch, self.calls = batch, 0

    def sample(self, global_steps, partition_id, batch_size):
        import transfer_queue as tq

        rows = list(range(self.calls * batch_size, (self.calls + 1) * batch_size))
        self.calls += 1
        keys = [f"{self.batch.non_tensor_batch['uid'][i]}_0_{i}" for i in rows]
        tags = [{"status": "success", "min_global_steps": global_steps - 1 - i % 2,
                 "max_global_steps": global_steps - 1} for i in rows]
        meta = tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=_tq_rows(self.batch, rows), tags=tags)
        return meta, {"training/off_policy/trajectory_staleness_worst": 1.0}


class _Stub:
    reward_loop_worker_handles = ()

    def sleep_replicas(self):
        return None


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("verl.trainer.ppo.v1") is None,
                    reason="verl before 0.9 has no V1 trainer")
def test_verls_v1_step_with_four_updates_logs_every_token_of_every_update_once(tmp_path):
    """The review's case (verl V1, ``parameter_sync_step=4``): 16 trajectories a step in 4 calls of 4, each call 2
    updates (2 epochs of one mini-batch): every token of every update logged once, every sample once, every token
    row joined to its own samples row, ``update_index`` 0..7, nothing refused or dropped; the rejection mask,
    the IS weights and the versions are verl's own."""
    import ray
    import transfer_queue as tq
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    batch, pi = make_batch(B=B, T=T, seed=44)
    cfg = ppo_config(**{
        "transfer_queue.enable": True, "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
        "trainer.v1.trainer_mode": "sync", "trainer.v1.sync.parameter_sync_step": TRIGGERS,
        "data.train_batch_size": B, "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
        "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": 2.0,
        "algorithm.rollout_correction.rollout_rs": "token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold": "0.6_1.6",
    })
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    try:
        tq.init(cfg.transfer_queue)
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, device_name="cpu",
                               ray_cls_with_init=RayClassWithInitArgs(_ray_actor_class(), pi=pi))
        trainer = object.__new__(PPOTrainerSync)
        trainer.config, trainer.tokenizer, trainer.global_steps, trainer.actor_rollout_wg = cfg, None, 5, group
        trainer.parameter_sync_step, trainer.local_trigger_step = TRIGGERS, 0
        trainer.replay_buffer, trainer.reward_loop_manager, trainer.checkpoint_manager = _Buffer(batch), _Stub(), _Stub()
        trainer.curr_step_profile, trainer.use_reference_policy, trainer.use_critic = False, False, False
        trainer.prepare_step = lambda: {}
        trainer._balance_batch = lambda batch, metrics=None, **kw: batch
        trainer._compute_old_log_prob = lambda batch, metrics=None: batch
        metrics: dict = {}
        with tv.attach(trainer, tmp_path, run_id="four") as run:
            combined = trainer.step(metrics, {})
        assert run.calls_per_step == TRIGGERS and len(combined.keys) == B
    finally:
        tq.close()
        ray.shutdown()

    run_dir = tmp_path / "four"
    assert S.validate_logdir(tmp_path) == [] and run_status(run_dir) == "finished"
    tokens, samples, steps = _read(run_dir, "tokens"), _read(run_dir, "samples"), _read(run_dir, "steps")
    b = batch.batch
    full = b["response_mask"].bool()
    # what verl's rollout correction computes on the same rows (GRPO groups never straddle a call)
    _, after, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=b["old_log_probs"], rollout_log_prob=b["rollout_log_probs"], response_mask=b["response_mask"],
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    rejected = full & ~after.bool()
    assert 0 < int(rejected.sum()) < int(full.sum())  # the case exercises the rejection

    # every sample once, every token once per update (2 epochs), all joined
    assert len(samples) == B and sorted(samples["sample_id"]) == list(range(B)) and set(samples["step"]) == {5}
    assert len(tokens) == 2 * int(full.sum())
    assert sorted(set(tokens["update_index"])) == list(range(2 * TRIGGERS))
    assert not tokens.duplicated(["sample_id", "pos", "update_index"]).any()
    joined = tokens.merge(samples[["step", "sample_id", "prompt_id", "length"]], on=["step", "sample_id"],
                          suffixes=("", "_s"))
    assert len(joined) == len(tokens) and (joined["prompt_id"] == joined["prompt_id_s"]).all()
    assert sorted(samples.sort_values("sample_id")["length"]) == sorted(full.sum(-1).tolist())
    # sample i trained by call i // 4, in its two epochs
    for sid, updates in tokens.groupby("sample_id")["update_index"]:
        assert sorted(set(updates)) == [2 * (sid // 4), 2 * (sid // 4) + 1], sid
    # the rows are verl's: tokens, mu, rejection mask, IS weight, kept never on a rejected token
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_array_equal(tokens["token_id"], b["responses"].numpy()[sid, pos])
    np.testing.assert_allclose(tokens["mu_logprob"], b["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    np.testing.assert_array_equal(tokens["rollout_rejected"], rejected.numpy()[sid, pos])
    assert not (tokens["kept"] & tokens["rollout_rejected"]).any()
    ratio = np.exp(b["old_log_probs"].numpy() - b["rollout_log_probs"].numpy())[sid, pos]
    np.testing.assert_allclose(tokens["is_weight"], np.minimum(ratio, 2.0), rtol=1e-5)
    assert (tokens["turn"] == 0).all()  # single-turn: a rejected token starts no turn
    # the trajectories' first and last weight versions from verl's tags (+1: verl's numbering)
    assert (tokens["policy_version"] == 5 - sid % 2).all() and (tokens["policy_version_last"] == 5).all()
    # verl's metrics of the step's calls: logged once, with the step's last call
    names = list(steps["name"])
    assert len(names) == len(set(names)) and "actor/pg_clipfrac" in names
    assert "rollout_corr/rollout_rs_token_k1_masked_fraction" in names or any(
        n.startswith("rollout_corr/") for n in names)


def test_calls_of_one_step_number_their_samples_and_updates_on(tmp_path):
    """Two ``_update_actor`` calls under one global step (verl's own ``RayPPOTrainer._update_actor``, an actor in
    this process): the second call's sample ids follow the first's, its updates follow the first's four (2 epochs
    x 2 mini-batches), every token row of every update is logged once and joins its samples row, verl's actor
    metrics are logged once for the step, and a new step starts both counts over."""
    first, pi_first = make_batch(B=8, seed=51)
    second, _ = make_batch(B=8, seed=52)
    pi = torch.cat([pi_first, pi_first])  # the toy actor reads pi at the sample id
    trainer = local_trainer(ppo_config(**{"actor_rollout_ref.actor.ppo_mini_batch_size": 2}), LocalActorGroup(pi))
    with tv.attach(trainer, tmp_path, run_id="calls") as run:
        trainer._update_actor(first)
        trainer._update_actor(second)
        trainer.global_steps = 2
        trainer._update_actor(first)
    assert run.mini_batch == 4 and run.epochs == 2
    assert S.validate_logdir(tmp_path) == [] and run_status(tmp_path / "calls") == "finished"
    tokens, samples, steps = (_read(tmp_path / "calls", t) for t in ("tokens", "samples", "steps"))
    n1, n2 = (int(b.batch["response_mask"].sum()) for b in (first, second))
    at1, at2 = tokens[tokens["step"] == 1], tokens[tokens["step"] == 2]
    assert len(at1) == 2 * (n1 + n2) and len(at2) == 2 * n1  # every token once per epoch
    assert sorted(samples[samples["step"] == 1]["sample_id"]) == list(range(16))
    assert sorted(samples[samples["step"] == 2]["sample_id"]) == list(range(8))
    assert sorted(set(at1["update_index"])) == list(range(8)) and sorted(set(at2["update_index"])) == list(range(4))
    assert (at1[at1["sample_id"] >= 8]["update_index"] >= 4).all() and (at1[at1["sample_id"] < 8]["update_index"] < 4).all()
    joined = tokens.merge(samples, on=["step", "sample_id"], suffixes=("", "_s"))
    assert len(joined) == len(tokens) and (joined["prompt_id"] == joined["prompt_id_s"]).all()
    b = second.batch
    late = at1[at1["sample_id"] >= 8]
    sid, pos = late["sample_id"].to_numpy() - 8, late["pos"].to_numpy()
    np.testing.assert_array_equal(late["token_id"], b["responses"].numpy()[sid, pos])
    np.testing.assert_allclose(late["mu_logprob"], b["rollout_log_probs"].numpy()[sid, pos], atol=1e-6)
    assert steps.groupby("step")["name"].apply(lambda n: n.is_unique).all()
    assert {"actor/pg_clipfrac"} <= set(steps[steps["step"] == 1]["name"])


def test_an_epoch_that_trains_other_tokens_is_refused_naming_step_update_and_field(tmp_path):
    """A response trained again in a later update of the call with other tokens (a loop that re-tokenized or
    re-masked between epochs) is refused at that micro-batch, naming the step, the update and the field; the first
    epoch's rows are logged."""
    batch, pi = make_batch(B=8, seed=53)
    from trustscope.logger import TokenLogger

    with TokenLogger(tmp_path / "drv", rank=0) as logger:
        tv.log_driver_batch(logger, batch, 4, updates=4)
    hook = tv.ActorLogHook(partial(ppo_loss, config=actor_config("trustscope_grpo")), tmp_path / "logs", "moved",
                           loss_rule="grpo")
    seen: list = []

    def loss_fn(**kw):
        seen.append(kw["data"])
        if len(seen) > 4:  # the second epoch: verl hands other tokens than the first trained
            kw["data"]["responses"] = kw["data"]["responses"] + 1
        return hook(**kw)

    with pytest.raises(tv.VerlUpdateMismatch, match=r"step 4, update 2: sample_id \d+ has other token ids than in "
                                                    r"update [01] \(field 'responses'\)"):
        run_actor(batch, pi, loss_fn, epochs=2)
    hook._logger.flush()
    logged = _read(tmp_path / "logs" / "moved", "tokens")
    assert sorted(set(logged["update_index"])) == [0, 1] and len(logged) == int(batch.batch["response_mask"].sum())
    hook.close()


def test_rollout_rejection_sampling_hides_no_token(tmp_path):
    """verl's rollout correction (``rollout_rs=token_k1`` with IS weights) through its own
    ``compute_rollout_correction_and_add_to_batch``, called as the V0 trainer calls it, then its own
    ``_update_actor``: every token of every response is logged (two epochs: twice), ``rollout_rejected`` is verl's
    rejection, ``kept`` is False on it, ``is_weight`` is verl's weight, and a multi-turn response's turns come from
    its tool gap, not from the rejected tokens."""
    from verl.trainer.ppo import rollout_corr_helper as helper

    batch, pi = make_batch(B=8, seed=61)
    b = batch.batch
    b["response_mask"][0, 2:4] = 0  # a tool's answer in response 0: its model turns are pos 0-1 and 4-5
    b["advantages"] = b["advantages"] * b["response_mask"]
    structure = b["response_mask"].bool().clone()
    cfg = ppo_config(**{"actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
                        "algorithm.rollout_correction.rollout_is": "token",
                        "algorithm.rollout_correction.rollout_rs": "token_k1",
                        "algorithm.rollout_correction.rollout_rs_threshold": "0.6_1.6"})
    trainer = local_trainer(cfg, LocalActorGroup(pi))
    with tv.attach(trainer, tmp_path, run_id="rs"):
        batch, _ = helper.compute_rollout_correction_and_add_to_batch(batch, cfg.algorithm.rollout_correction)
        trainer._update_actor(batch)
    assert helper.compute_rollout_correction_and_add_to_batch.__name__ == "compute_rollout_correction_and_add_to_batch"
    assert not hasattr(helper.compute_rollout_correction_and_add_to_batch, "__wrapped__")  # restored at close
    rejected = structure & ~batch.batch["response_mask"].bool()
    assert 0 < int(rejected.sum()) < int(structure.sum())  # the case exercises the rejection
    assert S.validate_logdir(tmp_path) == []
    tokens, samples = _read(tmp_path / "rs", "tokens"), _read(tmp_path / "rs", "samples")
    assert len(tokens) == 2 * int(structure.sum())  # every token of the response, once per epoch
    assert sorted(samples.sort_values("sample_id")["length"]) == sorted(structure.sum(-1).tolist())
    sid, pos = tokens["sample_id"].to_numpy(), tokens["pos"].to_numpy()
    np.testing.assert_array_equal(tokens["rollout_rejected"], rejected.numpy()[sid, pos])
    assert tokens["rollout_rejected"].any() and not (tokens["kept"] & tokens["rollout_rejected"]).any()
    weights = batch.batch["rollout_is_weights"].numpy()[sid, pos]
    np.testing.assert_allclose(tokens["is_weight"], weights, rtol=1e-6)
    first = tokens[tokens["sample_id"] == 0].drop_duplicates("pos").sort_values("pos")
    assert first["pos"].tolist() == [0, 1, 4, 5] and first["turn"].tolist() == [0, 0, 1, 1]
    assert (tokens[tokens["sample_id"] != 0]["turn"] == 0).all()  # a rejected token starts no turn
