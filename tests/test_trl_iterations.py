"""TRL's GRPOTrainer reusing each rollout for several optimizer steps (``steps_per_generation=2``,
``num_iterations=2``): every step's tokens are logged once, each row says which update since its rollout trained it
(``update_index``) and the step whose weights generated it (``policy_version``), checked against what TRL itself
generated and when (recorded by a wrapper of the test's own around TRL's ``_generate_single_turn``)."""

from __future__ import annotations

import pytest
from test_integration_trl import GROUP, make_trainer, read

from trustscope.integrations.trl import attach
from trustscope.runformat import validate_run

SPG, ITERATIONS, BATCH, STEPS = 2, 2, 8, 5
"""Steps per generation, iterations, completions per step, optimizer steps: TRL generates 16 completions at steps
0 and 4 (every SPG * ITERATIONS steps) and trains each at two steps (the second rollout's first slice only once
here: the run ends at step 4)."""

RESPONSES = "select sample_id, list(token_id order by pos) from tokens"


@pytest.fixture(scope="module")
def reused_run(toy_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-reuse")
    trainer = make_trainer(toy_model_dir, tmp / "out", steps=STEPS, per_device_train_batch_size=BATCH,
                           steps_per_generation=SPG, num_iterations=ITERATIONS)
    generated: list[tuple[int, tuple[int, ...]]] = []  # (global_step when TRL generated, completion ids)
    original = trainer._generate_single_turn

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        generated.extend((trainer.state.global_step, tuple(ids)) for ids in out[0])  # (completion_ids, logprobs)
        return out

    trainer._generate_single_turn = recording
    attach(trainer, tmp / "logs", run_id="reuse")
    trainer.train()
    return trainer, tmp / "logs" / "reuse", generated


@pytest.mark.slow
def test_every_step_logs_its_own_slice_once(reused_run):
    _trainer, run, generated = reused_run
    assert validate_run(run) == []
    assert [s for s, _ in generated[::2 * BATCH]] == [0, 4]  # TRL's own schedule: the test's premise
    per_step = dict(read(run, "select step, count(*) from samples group by step"))
    assert per_step == dict.fromkeys(range(STEPS), BATCH)
    # each token once: as many token rows per step as the step's samples have tokens, no (step, sample, pos) twice
    tokens = dict(read(run, "select step, count(*) from tokens group by step"))
    lengths = dict(read(run, "select step, sum(length) from samples group by step"))
    assert tokens == lengths and all(n > 0 for n in tokens.values())
    assert read(run, "select count(*) - count(distinct (step, sample_id, pos)) from tokens")[0][0] == 0
    # every token row joins its own samples row, and every samples row has tokens
    assert read(run, "select count(*) from tokens t anti join samples s using (step, sample_id)")[0][0] == 0
    assert read(run, "select count(*) from samples s anti join tokens t using (step, sample_id)")[0][0] == 0
    # a rollout's two slices are trained at two steps each: steps s and s + SPG hold the same samples, same tokens
    for first in (0, 1, 4):
        again = first + SPG
        if again >= STEPS:
            continue
        a = read(run, RESPONSES + " where step = ? group by 1 order by 1", first)
        b = read(run, RESPONSES + " where step = ? group by 1 order by 1", again)
        assert a == b and len(a) == BATCH, (first, again)
    # the two slices of one rollout are disjoint, and their ids unique within the rollout
    ids = [i for (i,) in read(run, "select sample_id from samples where step in (0, 1)")]
    assert len(ids) == len(set(ids)) == 2 * BATCH
    # the first rollout's 4 prompts, each with GROUP completions, each trained ITERATIONS times
    assert sorted(n for (n,) in read(run, "select count(*) from samples where step < 4 group by prompt_id")) \
        == [ITERATIONS * GROUP] * (2 * BATCH // GROUP)


@pytest.mark.slow
def test_policy_version_is_the_step_that_generated_and_update_index_counts_the_reuse(reused_run):
    _, run, generated = reused_run
    generated_at = {}
    for step, ids in generated:
        generated_at.setdefault(ids, set()).add(step)
    rows = read(run, "select step, list(token_id order by pos), min(policy_version), max(policy_version), "
                     "min(update_index), max(update_index) from tokens group by step, sample_id")
    assert len(rows) == STEPS * BATCH
    for step, response, lo, hi, u_lo, u_hi in rows:
        assert lo == hi and u_lo == u_hi, step
        # TRL generated this completion at that step (an id sequence two rollouts both produced names both)
        assert lo in generated_at[tuple(response)], (step, response, generated_at[tuple(response)])
        assert lo == (0 if step < 4 else 4)
        assert u_lo == step - lo  # one micro-batch per update: iteration x SPG + slice
    staleness = dict(read(run, "select step, max(step - policy_version) from tokens group by step"))
    assert staleness == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0}
