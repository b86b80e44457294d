"""The demo's setting, its closing lines and its log directory; the shipped run manifests name no machine path."""

import json
import os
import re
from pathlib import Path

import pytest

from trustscope import runformat
from trustscope.demo import DEMO_SETTING, demo_config, link_sample_runs, look_first

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_LOGS = ROOT / "sample_logs"
SHIPPED = sorted(SAMPLE_LOGS.glob("*/run.json"))


def _experiments():
    from script_modules import experiments

    return experiments()


def test_the_demo_trains_in_the_warm_climb_setting(tmp_path):
    """``toy-v2-warm`` in the setting of the ``sanity-climb-warm`` sweep: the mismatch knobs of the shipped runs
    (bf16 rollouts, lag, several mini-batches), 16 x 16, lr warmed up and decayed linearly; a lower peak lr and more
    mini-batches than the sweep (a rise that stays within the demo's steps, a trust region that binds), its length
    and evaluation cadence its own."""
    exp = _experiments()
    climb = {**exp.PRESETS["sanity-climb-warm"].setting, "model": exp.PRESETS["sanity-climb-warm"].toy}
    cfg = demo_config(tmp_path, steps=3, seed=2)
    for knob in ("model", "task", "engine", "engine_dtype", "trainer_dtype", "threads", "prompts_per_step", "group_size",
                 "max_tokens", "topk", "policy_lag", "lr_schedule", "grad_clip", "eval_problems"):
        assert getattr(cfg, knob) == climb[knob], knob
    assert cfg.lr < climb["lr"] and cfg.mini_batches >= climb["mini_batches"]
    assert cfg.engine == "vllm" and cfg.engine_dtype == "bfloat16" and cfg.policy_lag >= 1 and cfg.mini_batches > 1
    assert cfg.steps == 3 and cfg.seed == 2 and cfg.run_dir.parent == tmp_path and cfg.run_id.startswith("demo-")
    assert demo_config(tmp_path).warmup_steps == DEMO_SETTING["warmup_steps"] and cfg.warmup_steps == 1
    assert demo_config(tmp_path, steps=1).warmup_steps == 0


def _strings(value, where=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


MACHINE_PATH = re.compile(r"^(/|~|[A-Za-z]:[\\/]|\\\\)|(^|[\\/])(home|Users|root)[\\/]|\.cache[\\/]")


@pytest.mark.skipif(not SHIPPED, reason="no shipped sample logs in this checkout")
@pytest.mark.parametrize("manifest", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_manifests_name_no_path_of_the_machine(manifest):
    """No absolute path, home directory or user cache in a shipped run.json: relative names or cache keys only."""
    found = [f"{where}={value!r}" for where, value in _strings(json.loads(manifest.read_text()))
             if MACHINE_PATH.search(value)]
    assert not found, f"{manifest.relative_to(ROOT)} names paths of the machine that made it: {found}"


def test_the_path_check_catches_what_it_is_for():
    for bad in ("/root/.cache/trustscope/toy/addcol2-9b52d72f35573d24", "/work/main/runs/sanity-v2",
                "~/models/x", "C:\\Users\\me\\run", "data/home/me/x", "x/.cache/trustscope"):
        assert MACHINE_PATH.search(bad), bad
    for good in ("toy-v2", "toy/addcol2-9b52d72f35573d24", "runs/sanity-v2", "Qwen/Qwen3-1.7B-Base",
                 "processed_logprobs", "trustscope.engines.vllm.WeightSyncExtension", "2026-12-01T11:51:49+00:00"):
        assert not MACHINE_PATH.search(good), good


def test_the_manifest_records_portable_paths(tmp_path, monkeypatch):
    from trustscope.train.models import portable

    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert portable(tmp_path / "cache" / "toy" / "addcol2-abc") == "toy/addcol2-abc"
    assert portable(tmp_path / "runs" / "demo") == "runs/demo"
    assert portable("runs/demo") == "runs/demo" and portable("toy-v2") == "toy-v2"
    assert portable("Qwen/Qwen3-1.7B-Base") == "Qwen/Qwen3-1.7B-Base"
    elsewhere = str(Path(os.path.abspath(os.sep)) / "models" / "elsewhere")
    assert portable(elsewhere) == elsewhere  # a model outside the cache and the working directory: as given
    assert portable(tmp_path) == str(tmp_path)  # the working directory itself is no relative name


def test_toy_worlds_are_named_models(monkeypatch):
    import dataclasses

    import trustscope.train.toy as toy
    import trustscope.train.toy_models as toy_models
    from trustscope.train.config import TrainConfig
    from trustscope.train.models import resolve_model

    built, seeded = [], []
    monkeypatch.setattr(toy, "build_toy_model", lambda config, **kw: built.append((config, kw)) or Path("m"))
    monkeypatch.setattr(toy_models, "seed_cache", seeded.append)
    resolve_model(TrainConfig(model="toy-v2", task="addcol2", max_tokens=32, run_id="x"))
    resolve_model(TrainConfig(model="toy", run_id="x"))
    resolve_model(TrainConfig(model="toy-v2", task="add1", run_id="x"))  # warm-started on the run's task
    wanted = [toy.TOY_PRESETS["toy-v2"], toy.TOY_PRESETS["toy"],
              dataclasses.replace(toy.TOY_PRESETS["toy-v2"], task="add1")]
    assert built == [(c, {}) for c in wanted] and seeded == wanted
    assert resolve_model(TrainConfig(model="some/hub-model", run_id="x")) == "some/hub-model"


def test_an_unknown_toy_world_or_a_warm_start_short_of_its_target_is_refused(monkeypatch):
    """A toy-looking name that no preset has fails before any lookup, naming the model and the presets; a warm
    start that misses its target fails naming the world, the task and the accuracy reached."""
    import trustscope.train.toy as toy
    import trustscope.train.toy_models as toy_models
    from trustscope.train.config import ConfigError, TrainConfig
    from trustscope.train.models import resolve_model

    for name in ("toy-v3", "toy_v2", "toy-V2"):
        with pytest.raises(ConfigError, match=rf"model='{name}': no toy world of that name.*toy-v2"):
            resolve_model(TrainConfig(model=name, run_id="x"))

    def short(config, **kw):
        raise RuntimeError(f"warm start on task {config.task!r} reached expected accuracy 0.120 after 4000 steps, "
                           "short of target_accuracy=0.3; raise max_steps or lower the target")

    monkeypatch.setattr(toy, "build_toy_model", short)
    monkeypatch.setattr(toy_models, "seed_cache", lambda config: None)
    with pytest.raises(ConfigError, match=r"model='toy-v2' with task='addcol2': .*reached expected accuracy 0\.120"):
        resolve_model(TrainConfig(model="toy-v2", task="addcol2", max_tokens=32, run_id="x"))

    def broken(config, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(toy, "build_toy_model", broken)
    with pytest.raises(RuntimeError, match=r"^out of memory$"):  # any other failure passes through as it is
        resolve_model(TrainConfig(model="toy-v2", task="addcol2", max_tokens=32, run_id="x"))


def test_sample_runs_are_linked_beside_the_demo_run(tmp_path):
    if not runformat.run_dirs(SAMPLE_LOGS):
        pytest.skip("no shipped sample logs in this checkout")
    (tmp_path / "demo-run").mkdir()
    linked = link_sample_runs(tmp_path, SAMPLE_LOGS)
    assert sorted(linked) == sorted(p.name for p in runformat.run_dirs(SAMPLE_LOGS))
    assert all((tmp_path / name).is_symlink() and (tmp_path / name / "run.json").exists() for name in linked)
    assert not os.path.isabs(os.readlink(tmp_path / linked[0]))
    assert link_sample_runs(tmp_path, SAMPLE_LOGS) == []  # a second demo run leaves the links as they are
    assert link_sample_runs(SAMPLE_LOGS, SAMPLE_LOGS) == []  # never into the sample logs themselves


def test_closing_lines_name_the_page_and_the_run_s_own_numbers():
    """Read through the overview of a shipped run trained with the demo's rule: every line names a page and
    carries the run's figures, none of them made up."""
    run = SAMPLE_LOGS / f"sanity-{DEMO_SETTING['loss']}-s0"
    baseline = SAMPLE_LOGS / "sanity-pg_is-s0"
    if not (run / "run.json").exists() or not (baseline / "run.json").exists():
        pytest.skip("no shipped sample logs in this checkout")
    from trustscope.db import connect

    with connect(run, cache=False) as db:
        steps = db.overview().steps
    lines = look_first(run, [baseline])
    pages = ["Runs", "Rules side by side", "Counterfactual", "Bad negative updates", "Token explorer", "Then"]
    assert [line.split(":")[0].split(" sanity")[0] for line in lines] == pages, lines
    blocked = steps["n_trainer_blocked"].sum() / steps["n_nonzero_advantage"].sum()
    assert (f"blocked {int(steps['n_trainer_blocked'].sum()):,} of the {int(steps['n_nonzero_advantage'].sum()):,} "
            f"tokens with A != 0 ({100 * blocked:.1f}%)") in lines[0]
    assert f"mean |pi - mu| {steps['mismatch_mean'].mean():.4f}" in lines[0]
    worst = int(steps.loc[steps["trainer_blocked_frac"].idxmax(), "step"])
    assert f"step {worst}," in lines[4]
    assert "ppo_clip" in lines[2] and f"{int(steps['n_bad_negative'].sum()):,} tokens" in lines[3]
    assert baseline.name in lines[5] and "pg_is: no trust region" in lines[5]
    assert "not a matched pair" not in lines[5]  # the same world and lr: nothing to warn of
    assert all("\n" not in line for line in lines)


def test_the_closing_comparison_names_what_differs_from_the_shipped_pg_is_run(tmp_path):
    """A demo run in another setting than the shipped PG-IS run (the demo's own lag, mini-batches and lr, and
    another world): the closing line names every setting that differs with both values, says the pair is not
    matched, and carries both runs' figures, the baseline's lowest 10-step reward and its step among them."""
    import shutil

    import numpy as np

    baseline = SAMPLE_LOGS / "sanity-pg_is-s0"
    run = SAMPLE_LOGS / f"sanity-{DEMO_SETTING['loss']}-s0"
    if not (run / "run.json").exists() or not (baseline / "run.json").exists():
        pytest.skip("no shipped sample logs in this checkout")
    from trustscope.db import connect

    demo = tmp_path / run.name  # a copy under its own run id, its manifest in the demo's setting
    shutil.copytree(run, demo)
    manifest = json.loads((demo / "run.json").read_text())
    changed = {"model": "toy-v2-other", "policy_lag": DEMO_SETTING["policy_lag"],
               "mini_batches": DEMO_SETTING["mini_batches"], "lr": DEMO_SETTING["lr"]}
    theirs = json.loads((baseline / "run.json").read_text())["config"]
    assert all(theirs[k] != v for k, v in changed.items()), "the demo's setting should differ from the sweep's"
    manifest["config"].update(changed, seed=7, log_token_fraction=1.0, eval_every=3)  # not training settings
    (demo / "run.json").write_text(json.dumps(manifest))
    line = look_first(demo, [baseline])[-1]
    setting = line[line.index("(shipped, ") + len("(shipped, "):line.index("): ")].split(", ")
    assert setting == ["pg_is: no trust region", "in " + theirs["model"], "not this run's toy-v2-other",
                       f"policy_lag {theirs['policy_lag']} against {DEMO_SETTING['policy_lag']} here",
                       f"lr {theirs['lr']:.0e} against {DEMO_SETTING['lr']:.0e} here".replace("e-0", "e-"),
                       f"mini_batches {theirs['mini_batches']} against {DEMO_SETTING['mini_batches']} here"], line
    with connect([run, baseline], cache=False) as db:
        ov = db.overview()
    curve = ov.steps[ov.steps["run_id"] == baseline.name].sort_values("step")
    ten = curve["reward_mean"].rolling(10).mean().to_numpy()
    low = int(np.nanargmin(ten))
    peak = int(np.nanargmax(ten[:low + 1]))
    steps = curve["step"].to_numpy()
    assert (f"10-step reward from {ten[peak]:.2f} at step {steps[peak]} down to its lowest, {ten[low]:.2f} at step "
            f"{steps[low]}, and {ten[-1]:.2f} by step {steps[-1]}") in line, line
    assert f"mean |pi - mu| {curve['mismatch_mean'].mean():.4f}" in line and "not a matched pair" in line
    would = ov.blocked[(ov.blocked["run_id"] == baseline.name) & (ov.blocked["rule"] == DEMO_SETTING["loss"])
                       & (ov.blocked["advantage_side"] == "all")]
    share = would["n_blocked"].sum() / would["n_tokens"].sum()
    assert f"{DEMO_SETTING['loss']} would have blocked {100 * share:.1f}% of those with A != 0" in line


WORLDS = ("toy-v2", "toy-v2-warm")
"""The shipped toy worlds: the model of the sample logs and the demo (toy-v2-warm) and the one it was warm-started
from (toy-v2, the old sample logs' model: tests/data/legacy)."""


@pytest.mark.skipif(not SHIPPED, reason="no shipped sample logs in this checkout")
def test_the_sample_logs_were_trained_in_a_shipped_world():
    """Each shipped run names its model as a toy world whose build ships (a run in another world: ship its build,
    see trustscope/train/toy_models, and add it to WORLDS)."""
    models = {p.parent.name: json.loads(p.read_text())["model"]["name"] for p in SHIPPED}
    assert set(models.values()) <= set(WORLDS), models


@pytest.mark.parametrize("world", WORLDS)
def test_the_toy_worlds_ship_built_and_seed_an_empty_cache(tmp_path, world):
    """The sample logs' model and the demo's ship with the key a build would give them now, and each shipped run
    of the world names that build (a change to toy.py moves the key: ship the new build, see
    trustscope/train/toy_models); an empty cache takes them without a warm start."""
    from trustscope.train.toy import TOY_PRESETS, build_toy_model, toy_meta
    from trustscope.train.toy_models import seed_cache, shipped
    from trustscope.train.toy_warm import WARM_PRESETS, build_warm_model, warm_config

    config = warm_config(world) if world in WARM_PRESETS else TOY_PRESETS[world]
    source = shipped(config)
    assert source is not None, (f"trustscope/train/toy_models holds no {world} build with the current key "
                                f"{config.key()}: run the command in its docstring")
    for manifest in SHIPPED:
        model = json.loads(manifest.read_text())["model"]
        if model["name"] == world:
            assert model["path"] == f"toy/{source.name}", manifest.parent.name
    if world in WARM_PRESETS:  # the warm world's build seeds the cache itself
        entry = build_warm_model(world, cache_dir=tmp_path)
        assert entry == tmp_path / "toy" / source.name
    else:
        entry = seed_cache(config, cache_dir=tmp_path)
        assert entry == tmp_path / "toy" / source.name
    assert seed_cache(config, cache_dir=tmp_path) is None  # the cache has it now
    assert build_toy_model(config, cache_dir=tmp_path) == entry  # found, not built
    assert toy_meta(entry)["key"] == config.key()
    assert toy_meta(entry)["config"]["target_accuracy"] == config.target_accuracy
    assert (entry / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert not list((tmp_path / "toy").glob(".*"))  # no temporary folder left behind


def test_shipping_a_build_replaces_older_builds_of_its_configuration_only(monkeypatch, tmp_path):
    """``ship`` copies a build beside the others; an older build of the same fields (an older toy.py) goes, a
    build of other fields of the same task (toy-v2 beside toy-v2-warm) stays."""
    import trustscope.train.toy as toy
    import trustscope.train.toy_models as toy_models

    def entry(root, name, **fields):
        (root / name).mkdir(parents=True)
        (root / name / toy_models.META_FILE).write_text(json.dumps({"config": {"task": "addcol2", **fields}}))
        (root / name / "model.safetensors").write_bytes(name.encode())
        return root / name

    here = tmp_path / "ship"
    entry(here, "addcol2-old", target_accuracy=0.6)
    entry(here, "addcol2-v2", target_accuracy=0.3)
    built = entry(tmp_path / "cache", "addcol2-new", target_accuracy=0.6)
    monkeypatch.setattr(toy_models, "HERE", here)
    monkeypatch.setattr(toy, "build_toy_model", lambda config: built)
    assert toy_models.ship(toy.TOY_PRESETS["toy-v2"]) == here / "addcol2-new"
    assert sorted(p.name for p in here.iterdir()) == ["addcol2-new", "addcol2-v2"]
    assert (here / "addcol2-new" / "model.safetensors").read_bytes() == b"addcol2-new"


@pytest.mark.heavy
def test_the_demo_run_learns(tmp_path, monkeypatch, capsys):
    """The whole demo run, as `trustscope demo` trains it (no dashboard), in its own world (shipped built; 1-2
    minutes of training): its reward over the last five steps is
    clearly above the first five, the console shows each step's blocked share and count, and the closing lines
    print both rewards."""
    from trustscope.db import connect
    from trustscope.demo import DEMO_STEPS, run_demo

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    run_dir = run_demo(tmp_path, serve=False, samples=False)
    with connect(run_dir, cache=False) as db:
        steps = db.overview().steps.sort_values("step")
    reward = steps["reward_mean"]
    assert len(reward) == DEMO_STEPS and json.loads((run_dir / "run.json").read_text())["config"]["model"] == "toy-v2-warm"
    first, last = reward.head(5).mean(), reward.tail(5).mean()
    assert last >= first + 0.05, f"the demo's reward went {first:.2f} -> {last:.2f} over its {DEMO_STEPS} steps"
    assert steps["n_trainer_blocked"].sum() > 0  # the trust region had something to do
    closing = capsys.readouterr().err
    assert f"reward {first:.2f} over the first 5 steps, {last:.2f} over the last 5" in closing
    assert re.search(r"blocked \d+\.\d+%\s\(\d[\d,]*\sof\s\d[\d,]*\stokens\)", closing)


def test_the_warm_world_is_toy_v2_with_another_warm_start_and_names_itself_when_it_falls_short(monkeypatch, tmp_path):
    """``toy-v2-warm`` (the ``sanity-climb-warm`` sweep's world) is toy-v2's build with a higher warm-start target,
    toy-v2 itself untouched (its shipped build keeps its key); a preset name passes through; a warm start that
    falls short fails naming the world and its target."""
    import dataclasses

    import trustscope.train.toy as toy

    exp = _experiments()
    preset = exp.PRESETS["sanity-climb-warm"]
    base, change = exp.WORLDS[preset.toy]
    warm = dataclasses.replace(toy.TOY_PRESETS[base], **change)
    assert base == "toy-v2" and warm.target_accuracy > toy.TOY_PRESETS["toy-v2"].target_accuracy
    assert warm.key() != toy.TOY_PRESETS["toy-v2"].key() and preset.setting["task"] == warm.task
    assert exp.world_model("toy-v2") == "toy-v2"
    monkeypatch.setenv("TRUSTSCOPE_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(toy, "build_toy_model", lambda config: built.append(config) or Path("/cache/toy/x"))
    assert exp.world_model("toy-v2-warm") == "/cache/toy/x" and built == [warm]

    def short(config):
        raise RuntimeError("warm start on task 'addcol2' reached expected accuracy 0.410 after 4000 steps, short of "
                           "target_accuracy=0.6")

    monkeypatch.setattr(toy, "build_toy_model", short)
    with pytest.raises(SystemExit, match=r"toy-v2-warm.*target_accuracy=0.6"):
        exp.world_model("toy-v2-warm")
