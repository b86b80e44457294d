"""TRL's tool-calling loop on the vLLM path with top-K: TRL 1.16's own ``_tool_call_loop`` and
``_generate_single_turn`` run against a scripted engine behind attach's ``vllm_generate`` wrapper; every model turn's
top-K and engine ids are found again at the completion positions TRL spliced them into."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

import torch  # noqa: E402

from trustscope.integrations.trl import Attachment, engine_rows  # noqa: E402
from trustscope.integrations.trl.engine import _segments  # noqa: E402
from trustscope.integrations.trl.hooks import _ENGINE_IDS, _TOPK_IDS, _Hooks  # noqa: E402
from trustscope.train.toy import toy_tokenizer  # noqa: E402

K = 3


def scripted_engine(tok):
    """vLLM's ``generate`` as TRL's VLLMGeneration returns it, scripted: a prompt without a tool result calls
    ``(3*4)`` (odd rows answer ``7`` at once), after one result it calls ``(12+1)``, after two it answers ``13``.
    Log-prob lists are rank-ordered with the sampled token at rank 1 (as when vLLM returns K > 0 lists)."""

    def generate(prompts, images, num_generations, profiler=None):
        completions, logprobs, logprob_ids = [], [], []
        for row, ids in enumerate(prompts):
            text = tok.decode(ids, skip_special_tokens=True)
            calls = text.count(",")
            reply = ["(3*4)", "(12+1)", "13"][calls] if calls or row % 2 == 0 else "7"
            out = tok(reply, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if ")" not in reply else [])
            completions.append(out)
            logprobs.append([[-0.1 - 0.01 * t, -0.5 - 0.01 * t, -3.0, -4.0] for t in range(len(out))])
            logprob_ids.append([[(x + 1) % 60 + 4, x, (x + 2) % 60 + 4, (x + 3) % 60 + 4] for x in out])
        return [list(p) for p in prompts], completions, logprobs, logprob_ids

    return generate


def calc(expr: str) -> int:
    """A calculator of ``a*b`` and ``a+b``."""
    a, b = expr.replace("*", "+").split("+")
    return int(a) * int(b) if "*" in expr else int(a) + int(b)


def fake_trainer(tok, max_completion_length):
    hooks = _Hooks(SimpleNamespace(topk=K))
    generation = SimpleNamespace(generate=scripted_engine(tok), sync_weights=lambda: None,
                                 llm=SimpleNamespace(llm_engine=SimpleNamespace(
                                     model_config=SimpleNamespace(max_model_len=128))))
    hooks._wrap(generation, "generate", hooks.vllm_generate)
    t = SimpleNamespace(
        use_vllm=True, vllm_mode="colocate", vllm_generation=generation, max_completion_length=max_completion_length,
        max_tool_calling_iterations=5, _is_vlm=False, tools=[calc], environment_factories=None, _tokenizer=tok,
        state=SimpleNamespace(global_step=0), _last_loaded_step=0, args=SimpleNamespace(report_to=[]),
        accelerator=SimpleNamespace(is_main_process=True, device="cpu"),
        _get_tool_suffix_ids=lambda messages: tok("=" + messages[-1]["content"] + ",",
                                                  add_special_tokens=False)["input_ids"],
    )
    t._sync_tool_dicts = None
    t._async_tool_dicts = None
    t._generate_single_turn = trl_grpo.GRPOTrainer._generate_single_turn.__get__(t)
    return t, hooks


def parse(tok, ids, prefix=None, tools=None):
    text = tok.decode(ids, skip_special_tokens=True)
    out = {"role": "assistant", "content": text}
    if text.startswith("(") and text.endswith(")"):
        out["tool_calls"] = [{"type": "function", "function": {"name": "calc", "arguments": {"expr": text[1:-1]}}}]
    return out


@pytest.mark.parametrize("max_completion_length", [40, 14])
def test_tool_loop_top_k_lands_on_each_turns_tokens(monkeypatch, max_completion_length):
    tok = toy_tokenizer()
    monkeypatch.setattr(trl_grpo, "parse_response", parse)
    t, hooks = fake_trainer(tok, max_completion_length)
    G = 2
    prompt_ids = [tok("3*4+1=")["input_ids"]] * G + [tok("2*2+5=")["input_ids"]] * G
    t._sync_tool_dicts = [{"calc": calc}] * len(prompt_ids)
    t._async_tool_dicts = [{}] * len(prompt_ids)
    completion_ids, logprobs = t._generate_single_turn(prompt_ids, None, {}, G)
    completions = [[parse(tok, ids)] for ids in completion_ids]
    prompts = [[{"role": "user", "content": "q"}] for _ in prompt_ids]
    tool_mask, completions, completion_ids, logprobs, calls, failures, _ = trl_grpo.GRPOTrainer._tool_call_loop(
        t, prompts, prompt_ids, completion_ids, completions, logprobs, None, {})
    rounds = 3 if max_completion_length == 40 else 2  # the second reply would not fit in 14 tokens
    assert calls > 0 and failures == 0 and len(hooks._engine_calls) == rounds  # one engine call a round

    ids, topk = engine_rows(hooks._engine_calls, [tuple(p) for p in prompt_ids], completion_ids, tool_mask, K)
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    if max_completion_length == 40:
        assert texts == ["(3*4)=12,(12+1)=13,13", "7", "(3*4)=12,(12+1)=13,13", "7"]
    else:  # TRL cuts the post-tool turn at 14 tokens, and the reply after it would not fit: no third round
        assert texts == ["(3*4)=12,(12+1", "7", "(3*4)=12,(12+1", "7"]
    tk_ids, tk_lps = topk
    for i, comp in enumerate(completion_ids):
        for s, length in _segments(tool_mask[i]):
            for pos in range(s, s + length):
                assert ids[i][pos] == comp[pos]  # the engine's own id, from the call that sampled the turn
                assert comp[pos] in tk_ids[i][pos]  # mu's top-K at the engine's ranks
                sampled_rank = tk_ids[i][pos].index(comp[pos])
                # TRL's spliced log-prob (the wrapper put the sampled token's first) is the top-K's at its rank
                assert logprobs[i][pos] == pytest.approx(tk_lps[i][pos][sampled_rank])
        for pos, m in enumerate(tool_mask[i]):
            if not m:
                assert ids[i][pos] == -1 and all(math.isnan(x) for x in tk_lps[i][pos])
                assert logprobs[i][pos] == 0.0  # TRL pads the tool's result with 0.0: the mask must drop it
    assert [s for s, _ in _segments(tool_mask[0])][:2] == [0, 9]  # turn 1 starts after "(3*4)=12,"


def test_the_batch_carries_each_turns_engine_ids_and_topk_as_trl_pads_it(monkeypatch):
    """``tag_rollout``'s engine part on the batch TRL builds from the tool loop's lists (prompts left-padded,
    completions and tool mask right-padded, as ``_generate_and_score_completions`` pads them)."""
    from trl.trainer.utils import pad

    tok = toy_tokenizer()
    monkeypatch.setattr(trl_grpo, "parse_response", parse)
    t, hooks = fake_trainer(tok, 40)
    prompt_ids = [tok("3*4+1=")["input_ids"]] * 2 + [tok("12*2+5=")["input_ids"]] * 2
    t._sync_tool_dicts, t._async_tool_dicts = [{"calc": calc}] * 4, [{}] * 4
    completion_ids, logprobs = t._generate_single_turn(prompt_ids, None, {}, 2)
    completions = [[parse(tok, ids)] for ids in completion_ids]
    tool_mask, _, completion_ids, _, _, _, _ = trl_grpo.GRPOTrainer._tool_call_loop(
        t, [[{}] for _ in prompt_ids], prompt_ids, completion_ids, completions, logprobs, None, {})
    tensors = [torch.tensor(x) for x in completion_ids]
    out = {"prompt_ids": pad([torch.tensor(p) for p in prompt_ids], padding_value=0, padding_side="left"),
           "prompt_mask": pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0,
                              padding_side="left"),
           "completion_ids": pad(tensors, padding_value=0, padding_side="right"),
           "completion_mask": pad([torch.ones_like(x) for x in tensors], padding_value=0, padding_side="right"),
           "tool_mask": pad([torch.tensor(m) for m in tool_mask], padding_value=1, padding_side="right")}
    attachment = Attachment.__new__(Attachment)
    attachment.topk = K
    topk = attachment._tag_engine_ids(out, hooks._engine_calls)
    model = (out["tool_mask"] * out["completion_mask"]).bool()
    assert torch.equal(out[_ENGINE_IDS][model], out["completion_ids"][model])
    assert (out[_ENGINE_IDS][~model] == -1).all()
    assert topk is not None and len(topk[0]) == 4 and _TOPK_IDS not in out  # tag_rollout pads them in
