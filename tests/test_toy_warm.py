"""The warm toy world (``toy-v2-warm``): what it is, how a run finds it, and how a bad name or a warm start short
of its target fails."""

import dataclasses

import pytest
from typer.testing import CliRunner

import trustscope.train.toy as toy
from trustscope.train.config import ConfigError, TrainConfig
from trustscope.train.toy_warm import WARM_PRESETS, build_warm_model, cached, warm_config


def _experiments():
    from script_modules import experiments

    return experiments()


def test_toy_v2_warm_is_the_climb_sweep_s_world_and_leaves_toy_v2_alone():
    """The package's ``toy-v2-warm`` is the build the ``sanity-climb-warm`` sweep trains in (same fields, same cache
    key), toy-v2 with a higher warm-start target; toy-v2's own preset, and so its shipped build's key, is untouched."""
    exp = _experiments()
    base, change = exp.WORLDS["toy-v2-warm"]
    assert warm_config("toy-v2-warm") == dataclasses.replace(toy.TOY_PRESETS[base], **change)
    assert warm_config("toy-v2-warm").key() == dataclasses.replace(toy.TOY_PRESETS[base], **change).key()
    assert warm_config("toy-v2-warm").target_accuracy > toy.TOY_PRESETS["toy-v2"].target_accuracy
    assert warm_config("toy-v2-warm").key() != toy.TOY_PRESETS["toy-v2"].key()
    assert warm_config("toy-v2-warm", task="add1").task == "add1"
    assert not set(WARM_PRESETS) & set(toy.TOY_PRESETS)


def test_a_run_names_the_warm_world_and_it_is_built_on_the_run_s_task(monkeypatch, tmp_path):
    from trustscope.train.models import resolve_model

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(toy, "build_toy_model", lambda config, **kw: built.append(config) or tmp_path / "m")
    assert resolve_model(TrainConfig(model="toy-v2-warm", task="addcol2", max_tokens=32, run_id="x")) == tmp_path / "m"
    assert built == [warm_config("toy-v2-warm")]


def test_an_unknown_world_name_is_refused_naming_the_known_ones():
    from trustscope.train.models import resolve_model

    with pytest.raises(ValueError, match=r"toy world 'toy-v2-hot': no warm world of that name; known: toy-v2-warm"):
        warm_config("toy-v2-hot")
    with pytest.raises(ConfigError, match=r"model='toy-v2-warmer': no toy world of that name.*toy-v2-warm"):
        resolve_model(TrainConfig(model="toy-v2-warmer", run_id="x"))


def _short(config, **kw):
    raise RuntimeError(f"warm start on task {config.task!r} reached expected accuracy 0.410 after 4000 steps, "
                       f"short of target_accuracy={config.target_accuracy}; raise max_steps or lower the target")


def test_a_warm_start_short_of_its_target_names_the_world_the_target_and_what_it_reached(monkeypatch, tmp_path):
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr(toy, "build_toy_model", _short)
    with pytest.raises(ConfigError, match=r"^model='toy-v2-warm' \(toy-v2 warm-started to target_accuracy=0\.6\) "
                                          r"with task='addcol2': .*reached expected accuracy 0\.410 after 4000 steps, "
                                          r"short of target_accuracy=0\.6"):
        build_warm_model("toy-v2-warm")

    def broken(config, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(toy, "build_toy_model", broken)
    with pytest.raises(RuntimeError, match=r"^out of memory$"):  # any other failure passes through as it is
        build_warm_model("toy-v2-warm")


def test_the_demo_stops_with_the_warm_start_s_shortfall_and_trains_nothing(monkeypatch, tmp_path):
    """``trustscope demo`` on an empty cache whose warm start falls short: exit 2 with the world, its target and the
    accuracy reached, no run written."""
    import trustscope.train.toy_models as toy_models
    from trustscope.cli import app

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(toy_models, "shipped", lambda config: None)  # as after a change to toy.py moved the key
    monkeypatch.setattr(toy, "build_toy_model", _short)
    result = CliRunner().invoke(app, ["demo", "--no-serve", "--no-samples", "--logdir", str(tmp_path / "demo")])
    assert result.exit_code == 2, result.output
    assert "building the toy-v2-warm model" in result.output
    assert ("trustscope demo: model='toy-v2-warm' (toy-v2 warm-started to target_accuracy=0.6) with task='addcol2': "
            "warm start on task 'addcol2' reached expected accuracy 0.410") in result.output
    assert not (tmp_path / "demo").exists() or not any((tmp_path / "demo").iterdir())


def test_cached_finds_a_finished_build_only(monkeypatch, tmp_path):
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path))
    assert cached("toy-v2-warm") is None
    config = warm_config("toy-v2-warm")
    entry = tmp_path / "toy" / f"{config.task}-{config.key()}"
    entry.mkdir(parents=True)
    assert cached("toy-v2-warm") is None  # a folder without its build record is no build
    (entry / toy.META_FILE).write_text("{}")
    assert cached("toy-v2-warm") == entry
