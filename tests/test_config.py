"""TrainConfig: defaults, loading from JSON/TOML and overrides, and errors that say what to set."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trustscope.losses import list_losses
from trustscope.train.config import ConfigError, TrainConfig, field_docs, load_config


def test_defaults_are_valid_and_name_the_run():
    cfg = TrainConfig()
    assert cfg.run_id.startswith("dppo_binary_tv-s0-")
    assert cfg.batch_size == cfg.prompts_per_step * cfg.group_size
    assert cfg.run_dir.name == cfg.run_id


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().lr = 1.0  # type: ignore[misc]


def test_every_field_has_a_docstring():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    docs = field_docs()
    assert sorted(docs) == sorted(names)
    assert all(len(doc) > 10 for doc in docs.values())


def test_manifest_dict_round_trips_through_json():
    cfg = TrainConfig(loss="ppo_clip", loss_params={"eps_high": 0.3}, adam_betas=(0.9, 0.95), run_id="r1")
    again = TrainConfig(**json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("name", list_losses())
def test_every_registered_loss_has_a_valid_config(name):
    from trustscope.losses import get_loss

    needs_old = "old_logprob" in get_loss(name).needs
    assert TrainConfig(loss=name, recompute_old=needs_old).loss == name


def test_load_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('loss = "cispo"\nlr = 1e-5\nsteps = 7\n[loss_params]\nis_cap = 4.0\n')
    cfg = load_config(path, {"steps": "9", "std_normalize": True, "engine_dtype": "bfloat16"})
    assert (cfg.loss, cfg.lr, cfg.steps, cfg.std_normalize, cfg.engine_dtype) == ("cispo", 1e-5, 9, True, "bfloat16")
    assert cfg.loss_params == {"is_cap": 4.0}


def test_load_json_and_string_overrides_are_typed(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"group_size": 4, "recompute_old": True, "loss": "minirl"}))
    cfg = load_config(path, {"lr": "3e-4", "adam_betas": "0.9,0.99", "loss_params": '{"eps_low": 0.1}'})
    assert cfg.group_size == 4 and cfg.lr == 3e-4 and cfg.adam_betas == (0.9, 0.99)
    assert cfg.loss_params == {"eps_low": 0.1}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss": "ppo"}, "loss='ppo': set loss to a registered rule.*valid names: cispo"),
        ({"loss": "minirl"}, "recompute_old=False: loss 'minirl' is anchored on pi_old: set recompute_old=true"),
        ({"loss_params": {"delta": -1}}, "loss_params=.*delta=-1 must be >= 0"),
        ({"loss_params": {"eps": 0.2}}, r"'dppo_binary_tv' got unknown parameter\(s\) \['eps'\]; its parameters are"),
        ({"engine": "sglang"}, "engine='sglang': set engine to one of vllm, hf"),
        ({"engine_dtype": "fp8"}, "engine_dtype='fp8': set engine_dtype to one of float32, bfloat16"),
        ({"group_size": 1}, "group_size=1: set group_size >= 2"),
        ({"mini_batches": 3}, "mini_batches=3: set mini_batches to a divisor of .* = 64"),
        ({"lr": 0.0}, "lr=0.0: set lr to a positive number"),
        ({"temperature": 0.0}, "temperature=0.0: set temperature > 0"),
        ({"aggregation": "mean"}, "aggregation='mean': set aggregation to one of token_mean"),
        ({"task": "chess"}, "task='chess': set task to a registered task"),
        ({"resume": True}, "resume=True: set run_id"),
        ({"run_id": "../x"}, "run_id='../x': use letters"),
        ({"steps": 0}, "steps=0: set steps to a value >= 1"),
        ({"warmup_steps": 100, "steps": 10}, "warmup_steps=100: set warmup_steps <= steps"),
        ({"policy_lag": -1}, "policy_lag=-1: set policy_lag to a value >= 0"),
        ({"log_token_fraction": 0.0}, "log_token_fraction=0.0: set log_token_fraction in"),
    ],
)
def test_bad_values_say_what_to_set(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lrr": "1"}, "unknown config field 'lrr'; did you mean 'lr'"),
        ({"steps": "ten"}, "steps='ten': expected an integer"),
        ({"std_normalize": "maybe"}, "std_normalize='maybe': expected true or false"),
        ({"loss_params": "[1]"}, "loss_params='\\[1\\]': expected a JSON object"),
    ],
)
def test_bad_overrides_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    yaml = tmp_path / "run.yaml"
    yaml.write_text("lr: 1")
    with pytest.raises(ConfigError, match=r"use a \.json or \.toml file"):
        load_config(yaml)
    unknown = tmp_path / "u.json"
    unknown.write_text('{"learning_rate": 1e-5}')
    with pytest.raises(ConfigError, match=r"u\.json: unknown config field 'learning_rate'"):
        load_config(unknown)
