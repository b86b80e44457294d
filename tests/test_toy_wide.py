"""The toy world at a real vocabulary (``toy-v2-152k``): the widening keeps the base's model exactly on its own
tokens and gives the tail the mass it was asked for; the real-size world trains through vLLM with top-K, and every
read command and dashboard page opens the result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trustscope import paths
from trustscope.train import toy, toy_wide
from trustscope.train.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.heavy  # production shape: the 152k world built and trained, in .ci/run's own step
def test_widening_keeps_the_base_and_gives_the_tail_its_mass(tmp_path):
    config = toy_wide.WideToyConfig(vocab_size=3_000, tail_mass=0.01)
    path = toy_wide.build_wide_toy_model(config, cache_dir=tmp_path)
    assert path.parent == tmp_path / "toy" and path.name.startswith("wide-addcol2-")
    base_dir = toy.build_toy_model(config.base_config(), cache_dir=tmp_path)  # copied from the shipped build
    base, base_tok = toy.load_toy_model(base_dir)
    wide, tok = toy.load_toy_model(path)
    assert len(tok) == wide.config.vocab_size == 3_000 and not wide.config.tie_word_embeddings
    problems = get_task("addcol2").split("eval")
    batch = toy.encode_problems(tok, problems[:16])
    assert torch.equal(batch[0], toy.encode_problems(base_tok, problems[:16])[0])  # the same ids for the same text
    with torch.no_grad():
        lb = base(input_ids=batch[0], attention_mask=batch[1]).logits  # (B, L, 78)
        lw = wide(input_ids=batch[0], attention_mask=batch[1]).logits  # (B, L, 3000)
    torch.testing.assert_close(lw[..., :78], lb)  # the trained rows kept, the hidden states unchanged
    hidden = toy_wide.answer_hidden(wide, tok, problems)
    with torch.no_grad():
        probs = wide.lm_head(hidden).softmax(-1)  # (N, V) at every answer position of the eval split
    assert float(probs[:, 78:].sum(-1).mean()) == pytest.approx(0.01, rel=1e-3)
    meta = toy.toy_meta(path)
    assert meta["vocab_size"] == 3_000 and meta["tail"]["mean_mass"] == pytest.approx(0.01, rel=1e-3)
    assert 0 < meta["eval_expected_accuracy"] < meta["base"]["warm_start"]["eval_expected_accuracy"]
    tail_id = 78 + 5
    assert tok.decode([tail_id]) == toy_wide.tail_texts(6)[5] and len(tok.decode([tail_id])) >= 3
    assert wide.model.embed_tokens.weight[tail_id].equal(  # read as the letter its text starts with
        base.model.embed_tokens.weight[tok.convert_tokens_to_ids(tok.decode([tail_id])[0])])
    mtime = (path / toy.META_FILE).stat().st_mtime_ns
    assert toy_wide.build_wide_toy_model(config, cache_dir=tmp_path) == path  # cached
    assert (path / toy.META_FILE).stat().st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_tail_texts_are_distinct_words_of_letters():
    texts = toy_wide.tail_texts(20_000)
    assert len(set(texts)) == 20_000 and all(t.isalpha() and t.islower() and len(t) >= 3 for t in texts)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vocab_size", 78, "vocab_size must exceed"), ("tail_mass", 0.0, "tail_mass must be in"),
    ("tail_mass", 0.7, "tail_mass must be in"), ("base", "toy-v9", "base must be one of"),
    ("task", "nope", "nope")])
def test_bad_configurations_are_refused(field, value, message):
    with pytest.raises((ValueError, KeyError), match=message):
        toy_wide.WideToyConfig(**{field: value})


def test_the_trainer_knows_the_preset():
    from trustscope.train.config import ConfigError, TrainConfig
    from trustscope.train.models import resolve_model

    assert "toy-v2-152k" in toy_wide.WIDE_PRESETS
    with pytest.raises(ConfigError, match="toy-v2-152k"):  # the list of worlds names it
        resolve_model(TrainConfig(model="toy-v2-999k"))


@pytest.mark.slow
@pytest.mark.heavy  # production shape: the 152k world built and trained, in .ci/run's own step
def test_real_vocabulary_world_trains_logs_and_every_reader_opens_it(tmp_path, monkeypatch):
    """``trustscope train --model toy-v2-152k`` through vLLM with top-20, then report, doctor, validate, sql and
    every dashboard page on the log."""
    from typer.testing import CliRunner

    from trustscope.cli import app

    cache = Path(os.environ.get(paths.CACHE_ENV, "") or paths.cache_root())
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))  # the shared cache: the 152k world is built once a machine
    logdir = tmp_path / "runs"
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--model", "toy-v2-152k", "--task", "addcol2", "--steps", "2",
                                 "--prompts-per-step", "2", "--group-size", "4", "--max-tokens", "24", "--topk", "20",
                                 "--threads", "1", "--eval-every", "0", "--logdir", str(logdir), "--run-id", "wide"])
    assert result.exit_code == 0, result.output
    run = json.loads((logdir / "wide" / "run.json").read_text())
    assert run["tokenizer"]["vocab_size"] == 151_936 and run["sampling"]["topk_logprobs"] == 20

    def sql(query: str) -> list[dict]:
        out = runner.invoke(app, ["sql", str(logdir), query, "--format", "json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)

    assert sql("select count(*) as n, max(token_id) as top from vocab") == [{"n": 151_936, "top": 151_935}]
    counts = sql("select count(*) as n, count(*) filter (where list_max(mu_topk_ids) >= 78) as tail, "
                 "max(len(mu_topk_ids)) as k from tokens")[0]
    assert counts["n"] > 0 and counts["k"] == 20 and counts["tail"] > 0  # the tail is in mu's top-K
    assert len(sql("select * from summaries")) > 0 and len(sql("select * from samples")) == 16
    for command, says in ((["report", str(logdir)], "wide"), (["doctor", str(logdir)], "wide"),
                          (["validate", str(logdir)], "ok: 1 run(s)")):
        out = runner.invoke(app, command)
        assert out.exit_code == 0, (command, out.output)
        assert says in out.output, (command, out.output)

    every_page_opens(logdir, monkeypatch)


@pytest.mark.slow
@pytest.mark.heavy  # production shape: the MoE world at V = 151,936 built and trained through vLLM
def test_the_moe_world_at_a_real_vocabulary_trains_with_routing_logged_and_every_reader_opens_it(tmp_path,
                                                                                                monkeypatch):
    """``trustscope train --model toy-moe-152k`` through vLLM at bf16: both sides' experts logged on every token at
    V = 151,936, the routing checks pass (none fails on a healthy run), and report, validate and every dashboard
    page open the log."""
    from typer.testing import CliRunner

    from trustscope.cli import app
    from trustscope.db import connect
    from trustscope.doctor import diagnose

    cache = Path(os.environ.get(paths.CACHE_ENV, "") or paths.cache_root())
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))
    logdir = tmp_path / "runs"
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--model", "toy-moe-152k", "--task", "add1", "--steps", "2",
                                 "--prompts-per-step", "8", "--group-size", "4", "--engine-dtype", "bfloat16",
                                 "--threads", "1", "--eval-every", "0", "--logdir", str(logdir), "--run-id", "moe"])
    assert result.exit_code == 0, result.output
    run = json.loads((logdir / "moe" / "run.json").read_text())
    assert run["tokenizer"]["vocab_size"] == 151_936 and run["routing_shape"] == [2, 2, 4]
    with connect(logdir, cache=False) as db:
        counts = db.sql("select count(*) as n, count(engine_experts) as engine, count(trainer_experts) as trainer, "
                        "count(routing_agreement) as agreement from tokens").to_pandas().iloc[0]
        found = {f.check: f for f in diagnose(db)["moe"]}
    assert counts["n"] > 0 and counts["engine"] == counts["trainer"] == counts["agreement"] == counts["n"]
    routing = {name: f.verdict for name, f in found.items() if name.startswith("routing")}
    assert routing and "fail" not in routing.values(), routing
    for command, says in ((["report", str(logdir)], "moe"), (["validate", str(logdir)], "ok: 1 run(s)")):
        out = runner.invoke(app, command)
        assert out.exit_code == 0 and says in out.output, (command, out.output)
    every_page_opens(logdir, monkeypatch)


def every_page_opens(logdir: Path, monkeypatch) -> None:
    """Every dashboard page on ``logdir`` under Streamlit's AppTest: no exception, no error, its own title."""
    from streamlit.testing.v1 import AppTest

    from app.launch import LOGDIR_ENV
    from app.pages import PAGES

    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120)
    at.run()
    for page in PAGES:
        if not page.default:
            at.switch_page(page.script)
            at.run()
        assert not at.exception, (page.title, [e.message for e in at.exception])
        assert not at.error, (page.title, [e.value for e in at.error])
        assert [t.value for t in at.title] == [page.title]
