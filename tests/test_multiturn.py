"""Multi-turn tool use in the integrated trainer: the task, the rollout's splicing (tokens in, tokens out), the mask
and turns the trainer logs, and (slow) a short vLLM run that doctor passes and a one-position shift it fails."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trustscope.columns import turns_from_mask
from trustscope.engines.base import LOGPROB_FLOOR, Rollout
from trustscope.train.config import TrainConfig
from trustscope.train.multiturn import tool_rollout, turn_summary
from trustscope.train.tasks import calculator_reply, get_task, model_spans, tool_answer_reward
from trustscope.train.toy import toy_tokenizer

TASK = get_task("multool")


def test_calculator_and_reward():
    assert calculator_reply("(7*8)") == "=56," and calculator_reply("x(12+30)") == "=42,"
    assert calculator_reply("(7*)") == "=?," and calculator_reply("61") == "=?,"
    ref = "(7*8)=56,(56+5)=61,61"
    assert tool_answer_reward(ref, ref, "stop") == 1.0
    assert tool_answer_reward("61", ref, "stop") == 1.0  # the calls are not graded
    assert tool_answer_reward(ref, ref, "length") == 0.0
    assert tool_answer_reward("(7*8)=56,(56+5)=61,62", ref, "stop") == 0.0
    spans = "".join("m" if m else "e" for m in model_spans(TASK, ref))
    assert spans == "mmmmm" + "eeee" + "mmmmmm" + "eeee" + "mm"


class ReferenceEngine:
    """Writes each problem's reference turns, with made-up log-probs, and records the id prompts it was given."""

    name = "reference"

    def __init__(self, tokenizer, answers):
        self.tokenizer = tokenizer
        self.answers = answers  # prompt text -> reference trajectory
        self.calls: list[list[list[int]]] = []

    def extend(self, prompt_ids, max_tokens, temperature=1.0, top_p=1.0, topk=3, seed=None, stop_token_ids=()):
        self.calls.append([list(p) for p in prompt_ids])
        rows = []
        for ids, budget in zip(prompt_ids, max_tokens, strict=True):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            prompt = text[: text.index("=") + 1]
            done = text[len(prompt):]
            rest = self.answers[prompt][len(done):]
            stop = [self.tokenizer.decode([i]) for i in stop_token_ids]
            cut = min([rest.index(s) + 1 for s in stop if s in rest] or [len(rest)])
            out = self.tokenizer(rest[:cut], add_special_tokens=False)["input_ids"]
            if cut == len(rest):
                out.append(self.tokenizer.eos_token_id)
            rows.append(out[:budget])
        n = len(rows)
        return Rollout(prompts=[""] * n, n=1, topk=topk, prompt_index=list(range(n)), prompt_ids=list(prompt_ids),
                       response_ids=rows, mu_logprobs=[[-0.5] * len(r) for r in rows],
                       mu_topk_ids=[[[t] * topk for t in r] for r in rows],
                       mu_topk_logprobs=[[[-0.5] * topk for _ in r] for r in rows],
                       finish_reasons=["stop"] * n, texts=[""] * n, sampling={"engine": "reference"})


def test_tool_rollout_splices_the_replies_as_ids_and_masks_them():
    tok = toy_tokenizer()
    problems = [p for p in TASK.problems if p.prompt in ("7*8+5=", "0*3+9=")]
    engine = ReferenceEngine(tok, {p.prompt: p.answer for p in problems})
    ro = tool_rollout(engine, TASK, problems, n=2, max_tokens=32, temperature=1.0, top_p=1.0, topk=3, seed=0)
    assert len(ro) == 4 and ro.prompt_index == [0, 0, 1, 1]
    assert [len(c) for c in engine.calls] == [4, 4, 4]  # three turns, every trajectory still going
    for i in range(4):
        p = problems[i // 2]
        assert ro.texts[i] == p.answer and ro.finish_reasons[i] == "stop"
        # tokens in, tokens out: each turn's prompt is the previous turn's prompt + its ids + the reply's ids
        for turn in (1, 2):
            prev, now = engine.calls[turn - 1][i], engine.calls[turn][i]
            assert now[: len(prev)] == prev
            assert now == ro.prompt_ids[i] + ro.response_ids[i][: len(now) - len(ro.prompt_ids[i])]
        spans = [*model_spans(TASK, p.answer), True]  # EOS: the model's
        assert ro.sampled[i] == spans
        assert ro.engine_ids[i] == [t if s else -1 for t, s in zip(ro.response_ids[i], spans, strict=True)]
        model = np.asarray(spans)
        assert np.array_equal(np.asarray(ro.turns[i])[model], turns_from_mask(model)[model])  # the integrations' rule
        assert sorted(set(ro.turns[i])) == [0, 1, 2] and ro.turns[i][0] == 0 and ro.turns[i][-1] == 2
    assert TASK.score([problems[i // 2] for i in range(4)], ro.texts, ro.finish_reasons) == [1.0] * 4
    t = ro.to_tensors(pad_id=tok.pad_token_id)
    for i, sampled in enumerate(ro.sampled):
        n_t = len(sampled)
        assert t.mask[i, :n_t].tolist() == sampled and not t.mask[i, n_t:].any()
        assert t.attention_mask[i, t.prompt_len:].sum() == n_t  # the environment's tokens are inputs
        assert t.turn[i, :n_t].tolist() == ro.turns[i] and t.engine_ids[i, :n_t].tolist() == ro.engine_ids[i]
    assert torch.equal(t.input_ids[:, t.prompt_len:], t.response_ids) and t.turn.dtype == torch.int32
    env = ~t.mask
    assert (t.mu_topk_logprobs[env] == LOGPROB_FLOOR).all() and (t.mu_logprob[env] == 0).all()
    assert turn_summary(ro) == {"multiturn/turns_mean": 3.0, "multiturn/tool_calls_mean": 2.0,
                                "multiturn/env_token_frac": pytest.approx((2 * 8 + 2 * 6) / (2 * 22 + 2 * 18))}


def test_a_rank_share_keeps_each_tokens_turn_and_engine_id():
    from trustscope.train.ranks import shard_batch
    from trustscope.train.rollouts import StepRollouts

    tok = toy_tokenizer()
    problems = [p for p in TASK.problems if p.prompt in ("7*8+5=", "0*3+9=")]
    ro = tool_rollout(ReferenceEngine(tok, {p.prompt: p.answer for p in problems}), TASK, problems, n=2,
                      max_tokens=32, temperature=1.0, top_p=1.0, topk=3, seed=0)
    share = shard_batch(StepRollouts(0, problems, ro, torch.zeros(4)), rank=1, world=2).rollout
    assert share.sampled == ro.sampled[2:] and share.turns == ro.turns[2:] and share.engine_ids == ro.engine_ids[2:]


def test_a_reply_past_the_budget_ends_the_trajectory():
    tok = toy_tokenizer()
    problems = [p for p in TASK.problems if p.prompt == "7*8+5="]
    engine = ReferenceEngine(tok, {p.prompt: p.answer for p in problems})
    ro = tool_rollout(engine, TASK, problems, n=1, max_tokens=12, temperature=1.0, top_p=1.0, topk=3, seed=0)
    # turn 0 (5) + reply (4) + turn 1 (3 of 6, cut by the budget): no second reply, no EOS
    assert ro.texts == ["(7*8)=56,(56"] and ro.finish_reasons == ["length"] and len(engine.calls) == 2


def test_hf_extend_stops_on_a_stop_id_and_scores_as_teacher_forcing(toy_model_dir):
    from trustscope.engines import make_engine

    engine = make_engine("hf", toy_model_dir, seed=0)
    tok = engine.tokenizer
    digits = tok("0123456789", add_special_tokens=False)["input_ids"]
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "9+9=", "5+6=")]
    ro = engine.extend(prompts, [4, 4, 1], topk=5, seed=3, stop_token_ids=digits)
    assert ro.prompt_ids == prompts  # tokens in: the prompts' ids, as given
    for ids, finish in zip(ro.response_ids, ro.finish_reasons, strict=True):
        ends = [t for t, tok_id in enumerate(ids) if tok_id in [*digits, tok.eos_token_id]]
        assert (finish == "stop") == bool(ends) and (not ends or ends == [len(ids) - 1])  # the stop id kept last
    assert len(ro.response_ids[2]) == 1
    lp, _, tensors = engine.score(ro)
    assert torch.allclose(lp[tensors.mask], tensors.mu_logprob[tensors.mask], atol=1e-5)


def test_asynchronous_partial_rollouts_of_a_multi_turn_task_are_refused():
    from trustscope.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"async_chunk_tokens=4: task 'multool' is multi-turn"):
        TrainConfig(task="multool", model="toy-tool", async_chunk_tokens=4, run_id="x")


# ---------------------------------------------------------------------------------------------------------------
# end to end with vLLM


def shift_from_turn_one(run_dir, out_dir):
    """A copy of a run whose pi is one position late from turn 1 on (a separator dropped at the first tool
    boundary): pi at each token of turns >= 1 is the trainer's log-prob of the token before it."""
    shutil.copytree(run_dir, out_dir)
    for path in sorted(out_dir.glob("tokens/**/*.parquet")):
        table = pq.read_table(path)
        df = table.to_pandas()
        df = df.sort_values(["step", "sample_id", "pos"])
        later = df["turn"] >= 1
        prev = df.groupby(["step", "sample_id"])["pi_logprob"].shift(1)
        df.loc[later, "pi_logprob"] = prev[later].astype(np.float32)
        df = df.sort_index()
        pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), path)
    return out_dir


@pytest.mark.slow
def test_a_tool_run_logs_turns_and_engine_ids_and_passes_the_turn_checks(tmp_path):
    from trustscope.db import connect
    from trustscope.doctor import diagnose
    from trustscope.train.loop import train

    cfg = TrainConfig(model="toy-tool", task="multool", steps=2, max_tokens=32, prompts_per_step=4, group_size=4,
                      topk=5, eval_every=2, eval_problems=16, threads=1, engine_dtype="bfloat16",
                      logdir=str(tmp_path / "runs"), run_id="tool")
    scalars = train(cfg)
    assert scalars["multiturn/turns_mean"] > 1 and 0 < scalars["multiturn/env_token_frac"] < 1
    assert 0 <= scalars["eval/reward"] <= 1
    db = connect(cfg.logdir)
    rows = db.sql("select turn, count(*) as n, count_if(engine_token_id = token_id) as same, "
                  "count(engine_token_id) as logged from tokens group by turn order by turn").to_pandas()
    assert list(rows["turn"])[:2] == [0, 1] and (rows["same"] == rows["n"]).all() and (rows["logged"] == rows["n"]).all()
    # the environment's tokens are not in the log: a response's positions jump over each reply
    gaps = db.sql("select count(*) from (select pos - lag(pos) over (partition by step, sample_id order by pos) as d "
                  "from tokens) where d > 1").to_pandas().iloc[0, 0]
    assert gaps > 0
    found = {f.check: f for f in diagnose(db)["tool"]}
    for check in ("turn_alignment", "turn_placeholders", "token_drift", "alignment"):
        assert found[check].verdict == "ok", (check, found[check].summary)
    shifted = shift_from_turn_one(cfg.run_dir, tmp_path / "shifted" / "tool")
    found = {f.check: f for f in diagnose(connect(shifted.parent))["tool"]}
    assert found["turn_alignment"].verdict == "fail" and "starts at a turn boundary" in found["turn_alignment"].cause


def test_a_run_whose_rules_never_block_still_has_its_zeros_by_turn(tmp_path):
    """The page and the report read "0 of N" for a run where no rule blocked a token (one update a step: pi is
    mu up to the engine's numerics), not a missing row (which drew "-" and gave the run another colour in the blocked panels)."""
    from trustscope import report_where
    from trustscope.db import connect
    from trustscope.logger import TokenLogger

    rng = np.random.default_rng(0)
    with TokenLogger(tmp_path, "quiet", vocab=[f"t{i}" for i in range(8)], loss_rule="dppo_binary_tv") as logger:
        for step in range(2):
            lp = np.log(rng.uniform(0.2, 0.9, size=(4, 6))).astype(np.float32)
            logger.log_step(step, tokens={"token_id": rng.integers(0, 8, size=(4, 6)), "mu_logprob": lp,
                                          "pi_logprob": lp + np.float32(1e-4), "advantage": np.repeat([[1.0], [-1.0]] * 2, 6, axis=1),
                                          "turn": np.repeat([[0, 0, 0, 1, 1, 1]], 4, axis=0)},
                            mask=np.ones((4, 6), dtype=bool),
                            samples={"sample_id": np.arange(4), "prompt_id": np.arange(4) // 2})
    _, blocked = report_where.by_dimension(connect(tmp_path))
    turns = blocked[blocked.dimension == "turn"]
    assert {"dppo_binary_tv", "ppo_clip"} <= set(turns.rule)
    assert (turns.n_blocked == 0).all() and (turns.n_nonzero_advantage == 2 * 4 * 3).all()
