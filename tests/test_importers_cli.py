"""``trustscope import FORMAT SRC LOGDIR``: each format end to end through the CLI, then validate and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_importers_nemo_rl import write_log_dir
from test_importers_prime_rl import write_export
from test_importers_slime import write_dump
from typer.testing import CliRunner

from trustscope.cli import app
from trustscope.importers import IMPORTERS, register_importer

runner = CliRunner()

WRITERS = {
    "prime-rl": lambda p: write_export(p, steps=2),
    "miles": lambda p: write_dump(p, steps=2, tp=1, pp=1),
    "slime": lambda p: write_dump(p, steps=2, kind="slime"),
    "nemo-rl": lambda p: write_log_dir(p, steps=2),
}
"""A small source of each registered format, as its framework writes it (the importers' own test fixtures)."""


@pytest.mark.parametrize("fmt", list(IMPORTERS))
def test_import_then_validate_and_report(tmp_path, fmt):
    assert fmt in WRITERS, f"no test source for the registered format {fmt!r}: add its writer to WRITERS"
    WRITERS[fmt](tmp_path / "src")
    result = runner.invoke(app, ["import", fmt, str(tmp_path / "src"), str(tmp_path / "logs"), "--run-id", "r",
                                 "--source-version", "9.9"])
    assert result.exit_code == 0, result.output
    assert "imported" in result.output
    manifest = json.loads((tmp_path / "logs/r/run.json").read_text())
    assert manifest["source"]["framework"] == fmt and manifest["source"]["version"] == "9.9"
    assert manifest["status"] == "finished" and manifest["mu_source"] == "imported"
    result = runner.invoke(app, ["validate", str(tmp_path / "logs")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["report", str(tmp_path / "logs")], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "what each rule would block" in result.output and "tokens with A != 0" in result.output


def test_bad_input_exits_1_naming_file_and_line(tmp_path):
    write_export(tmp_path / "src", steps=1)
    path = tmp_path / "src/token_exports/step_0/rank_1.jsonl"
    path.write_bytes(path.read_bytes()[:-10])
    result = runner.invoke(app, ["import", "prime-rl", str(tmp_path / "src"), str(tmp_path / "logs")])
    assert result.exit_code == 1
    assert f"{path}:" in result.stderr and "truncated" in result.stderr
    assert not (tmp_path / "logs").exists() or list((tmp_path / "logs").iterdir()) == []


def test_fields_trustscope_does_not_know_are_named_once_on_stderr(tmp_path):
    write_export(tmp_path / "src", steps=2)
    for path in (tmp_path / "src/token_exports").glob("step_*/rank_*.jsonl"):
        path.write_text("".join(json.dumps({**json.loads(line), "judge": "ok"}) + "\n"
                                for line in path.read_text().splitlines()))
    result = runner.invoke(app, ["import", "prime-rl", str(tmp_path / "src"), str(tmp_path / "logs"), "--run-id",
                                 "r", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("fields trustscope does not know") == 1
    assert "kept as the run's own columns: judge (string)" in result.stderr
    result = runner.invoke(app, ["import", "--follow", "prime-rl", str(tmp_path / "src"), str(tmp_path / "logs"),
                                 "--workers", "2"])
    assert result.exit_code == 2 and "--workers is an option of a one-shot import" in result.stderr


def test_unknown_format_and_existing_run(tmp_path):
    result = runner.invoke(app, ["import", "openrlhf", str(tmp_path), str(tmp_path / "logs")])
    assert result.exit_code == 2 and "known: nemo-rl, prime-rl, slime, miles" in result.stderr
    write_export(tmp_path / "src", steps=1)
    args = ["import", "prime-rl", str(tmp_path / "src"), str(tmp_path / "logs"), "--run-id", "r"]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "already exists" in result.stderr


def test_an_option_is_refused_by_a_format_that_does_not_take_it(tmp_path):
    write_export(tmp_path / "src", steps=1)
    result = runner.invoke(app, ["import", "prime-rl", str(tmp_path / "src"), str(tmp_path / "logs"),
                                 "--allow-pickle"])
    assert result.exit_code == 2
    assert "'prime-rl' takes no option allow_pickle (allow_pickle: slime, miles)" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_a_format_is_registered_once():
    with pytest.raises(ValueError, match="'slime' is registered twice"):
        register_importer("slime", reads="anything")(IMPORTERS["slime"].read)
    assert IMPORTERS["slime"].reads.startswith("a --dump-details directory")


def test_help_lists_every_format_and_who_takes_each_option():
    result = runner.invoke(app, ["import", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the help is wrapped
    for fmt in IMPORTERS.values():
        assert f"{fmt.name}: {fmt.reads}" in text
    assert "slime, miles: unpickle .pt files" in text


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl"])
def test_json_lines_formats_read_without_torch(tmp_path, fmt):
    # Reading JSON lines needs no torch (seconds to import); only the .pt formats load it, inside their reader.
    WRITERS[fmt](tmp_path / "src")
    code = (f"import sys; from trustscope.importers import read_source; "
            f"run = read_source({fmt!r}, {str(tmp_path / 'src')!r}); "
            f"print(len(run.sequences), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n, torch_imported = out.stdout.split()
    assert int(n) > 0 and torch_imported == "False", out.stderr


def test_dashboard_runs_page_shows_imported_runs(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from app.launch import LOGDIR_ENV
    from trustscope.importers import import_run

    write_export(tmp_path / "prime", steps=2)
    write_dump(tmp_path / "miles", steps=2, tp=1, pp=1)
    write_log_dir(tmp_path / "nemo", steps=2)
    for fmt, src in (("prime-rl", "prime"), ("miles", "miles"), ("nemo-rl", "nemo")):
        import_run(fmt, tmp_path / src, tmp_path / "logs", run_id=src)
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "logs"))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app" / "main.py"), default_timeout=60)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert sorted(at.dataframe[0].value["run_id"]) == ["miles", "nemo", "prime"]


def test_tokenizer_names_tokens_and_bounds_ids(tmp_path):
    from trustscope.train.toy import toy_tokenizer

    tok = toy_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    write_log_dir(tmp_path / "nemo", steps=1)  # token ids < 40 <= the toy vocabulary
    args = ["import", "nemo-rl", str(tmp_path / "nemo"), str(tmp_path / "logs"), "--tokenizer", str(tmp_path / "tok")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    vocab = pq.read_table(tmp_path / "logs/nemo-rl-nemo/vocab.parquet").to_pandas()
    assert len(vocab) == len(tok) and vocab.text[5] == tok.decode([5])
    assert runner.invoke(app, ["validate", str(tmp_path / "logs")]).exit_code == 0
    write_export(tmp_path / "prime", steps=1)
    big = tmp_path / "prime/token_exports/step_0/rank_0.jsonl"
    lines = big.read_text().splitlines()
    record = json.loads(lines[0])
    first = record["loss_mask"].index(True)
    record["token_ids"][first] = len(tok) + 3
    lines[0] = json.dumps(record)
    big.write_text("\n".join(lines) + "\n")
    args = ["import", "prime-rl", str(tmp_path / "prime"), str(tmp_path / "logs2"), "--tokenizer", str(tmp_path / "tok")]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert f"{big}:1: token_id {len(tok) + 3} at response position 0: the tokenizer has {len(tok)} tokens" in result.stderr
