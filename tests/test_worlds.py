"""The toy-world registry: every family's preset table is a world, and the trainer, parity and the demo find worlds
through the registry alone (a family registered at run time is trained, refused names list it)."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest

from trustscope.train import worlds as w
from trustscope.train.config import ConfigError, TrainConfig


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    task: str = "add1"
    size: int = 1


@pytest.fixture
def fake_family(monkeypatch, tmp_path):
    """A family ``fake`` registered for the test: world ``toy-fake``, whose build records its configuration."""
    module = types.ModuleType("fake_worlds")
    module.FAKE_PRESETS = {"toy-fake": FakeConfig(size=7)}
    monkeypatch.setitem(sys.modules, "fake_worlds", module)
    built = []

    def build(name: str, config: FakeConfig) -> Path:
        built.append((name, config))
        return tmp_path / name

    monkeypatch.setattr(w, "FAMILIES", dict(w.FAMILIES))
    w.register_family(w.Family("fake", "fake_worlds", "FAKE_PRESETS", "a test family", build))
    return built


def test_every_preset_table_entry_is_a_world_and_only_those():
    from trustscope.train.toy import TOY_PRESETS
    from trustscope.train.toy_moe import MOE_PRESETS
    from trustscope.train.toy_tool import TOOL_PRESETS
    from trustscope.train.toy_warm import WARM_PRESETS
    from trustscope.train.toy_wide import WIDE_PRESETS

    tables = [TOY_PRESETS, WARM_PRESETS, MOE_PRESETS, TOOL_PRESETS, WIDE_PRESETS]
    assert list(w.worlds()) == [name for table in tables for name in table]
    assert w.get_world("toy-v2").config("add2") == dataclasses.replace(TOY_PRESETS["toy-v2"], task="add2")
    assert w.get_world("toy-moe").config() == MOE_PRESETS["toy-moe"]
    from trustscope.train.toy_warm import warm_config

    assert w.get_world("toy-v2-warm").config("add2") == warm_config("toy-v2-warm", "add2")


def test_the_trainer_builds_a_registered_world_on_the_run_task(fake_family, tmp_path):
    from trustscope.train.models import resolve_model

    assert resolve_model(TrainConfig(run_id="x", model="toy-fake", task="add2")) == tmp_path / "toy-fake"
    assert fake_family == [("toy-fake", FakeConfig(task="add2", size=7))]
    assert resolve_model(TrainConfig(run_id="x", model="Qwen/Qwen3-0.6B")) == "Qwen/Qwen3-0.6B"  # a hub name


def test_a_toy_like_name_no_family_holds_is_refused_naming_every_world(fake_family):
    from trustscope.train.models import resolve_model

    with pytest.raises(ConfigError, match=r"model='toy-fakes': no toy world of that name.*toy-v2-warm.*toy-fake,"):
        resolve_model(TrainConfig(run_id="x", model="toy-fakes"))
    assert fake_family == []


def test_a_family_or_a_world_declared_twice_is_refused(fake_family, monkeypatch):
    with pytest.raises(ValueError, match="family 'fake' is registered already"):
        w.register_family(w.Family("fake", "fake_worlds", "FAKE_PRESETS", "again", lambda n, c: Path(n)))
    sys.modules["fake_worlds"].OTHER = {"toy-v2": FakeConfig()}
    w.register_family(w.Family("other", "fake_worlds", "OTHER", "clash", lambda n, c: Path(n)))
    with pytest.raises(ValueError, match="'toy-v2' is declared by both 'dense' and 'other'"):
        w.worlds()


def test_parity_builds_a_registered_world(fake_family, monkeypatch):
    from typer.testing import CliRunner

    import trustscope.parity as parity
    from trustscope.cli import app

    seen = []
    monkeypatch.setattr(parity, "run_parity", lambda model_dir, *a, **k: seen.append(model_dir) or 1 / 0)
    result = CliRunner().invoke(app, ["parity", "--model", "toy-fake", "--prompts", "add1"])
    assert seen and seen[0].endswith("toy-fake") and fake_family[0][1] == FakeConfig(size=7)
    result = CliRunner().invoke(app, ["parity", "--model", "toy-nothing", "--prompts", "add1"])
    assert result.exit_code == 2 and "toy-fake" in result.output and "toy-v2-152k" in result.output


def test_the_demo_reads_its_world_from_the_registry(fake_family, monkeypatch):
    from trustscope import demo

    cfg = demo.demo_config(Path("unused"))
    assert demo.toy_ready(cfg)  # toy-v2-warm ships built
    with pytest.raises(ValueError, match="model='toy-nothing': the demo trains a registered toy world"):
        demo.toy_ready(dataclasses.replace(cfg, model="toy-nothing"))


def test_the_extending_recipe_registers_a_family_the_trainer_finds(monkeypatch):
    """docs/extending.md's toy-world recipe, run as written: its worlds are registered, configured for a task and
    named when a near name is refused."""
    import re

    from trustscope.train.models import resolve_model

    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = text.split("## A toy world\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    module = types.ModuleType("tiny_worlds")
    monkeypatch.setitem(sys.modules, "tiny_worlds", module)
    monkeypatch.setattr(w, "FAMILIES", dict(w.FAMILIES))
    exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
    assert list(w.worlds())[-2:] == ["toy-tiny", "toy-tiny-deep"]
    world = w.get_world("toy-tiny-deep")
    assert world.family.build is module.build_tiny and world.family.name == "tiny"
    assert world.config("add2") == module.TinyConfig(task="add2", layers=4)
    with pytest.raises(ConfigError, match=r"no toy world of that name.*toy-tiny, toy-tiny-deep"):
        resolve_model(TrainConfig(run_id="x", model="toy-tinyy"))
