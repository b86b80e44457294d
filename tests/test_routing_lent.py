"""Routed-expert lists are lent to the writer thread, not copied at the call: ``log_step`` keeps a reference to the
caller's buffer, and a buffer the caller changes before the writer has read it (a framework that refills one buffer)
loses that call's routing, never silently: the ``routing_buffer_changed`` incident, null routing columns for the
call, the other columns kept, and routing copied at the call from then on."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_routing_storage import SHAPE, perturbed, random_routing, step_tokens

from trustscope.logger import LogWarning, TokenLogger
from trustscope.logger import writer as writer_module
from trustscope.logger.experts import handoff


@pytest.fixture
def held_writer(monkeypatch):
    """The writer thread waits before it reads a call's routing until the test lets it go."""
    go = threading.Event()
    derive = writer_module.derive_routing

    def waiting(cols, step, plan):
        assert go.wait(30), "the test never let the writer go"
        return derive(cols, step, plan)

    monkeypatch.setattr(writer_module, "derive_routing", waiting)
    return go


def rows(tmp_path, run_id: str) -> dict:
    files = sorted((tmp_path / run_id / "tokens").rglob("*.parquet"))
    table = pq.read_table(files, columns=["step", "sample_id", "pos", "mu_logprob", "engine_experts",
                                          "routing_agreement"]).to_pydict()
    return table


def logged(tmp_path, run_id: str, step: int) -> tuple[list, list, list]:
    t = rows(tmp_path, run_id)
    at = [i for i, s in enumerate(t["step"]) if s == step]
    return ([t["engine_experts"][i] for i in at], [t["routing_agreement"][i] for i in at],
            [t["mu_logprob"][i] for i in at])


def one_step(rng, b: int = 4, t: int = 8) -> dict:
    tokens = step_tokens(rng, b, t)
    engine = random_routing(rng, (b, t))
    return tokens | {"engine_experts": engine, "trainer_experts": perturbed(rng, engine, 0.1)}


def test_a_lent_buffer_is_written_as_given_when_the_caller_leaves_it(tmp_path, held_writer):
    rng = np.random.default_rng(0)
    tokens = one_step(rng)
    want = tokens["engine_experts"].copy()
    with TokenLogger(tmp_path, "r", routing_shape=SHAPE, routing_fraction=1.0) as logger:
        logger.log_step(0, tokens=tokens)
        held_writer.set()
    lists, agreement, _ = logged(tmp_path, "r", 0)
    assert np.array_equal(np.array(lists).reshape(want.shape), want)
    assert all(a is not None for a in agreement)
    assert not logger.incidents


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_buffer_refilled_before_the_writer_read_it_loses_its_routing_loudly(tmp_path, held_writer, kind):
    """numpy: the probed rows differ; torch: the version counter moved, though one id outside the probed rows
    changed (the probe alone would not see it)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    first, second = one_step(rng, 4, 128), one_step(rng)  # 512 rows: 256 of them probed, row 1 not
    buffer = first["engine_experts"]
    if kind == "torch":
        buffer = torch.from_numpy(buffer.copy())
        first["engine_experts"] = buffer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TokenLogger(tmp_path, "r", routing_shape=SHAPE, routing_fraction=1.0) as logger:
            logger.log_step(0, tokens=first)
            if kind == "numpy":
                buffer[:] = (buffer + 1) % SHAPE[2]  # the framework refills its buffer for the next step
            else:
                buffer[0, 1, 0, 0] = (int(buffer[0, 1, 0, 0]) + 1) % SHAPE[2]  # row 1: not a probed row
            held_writer.set()
            logger.flush()
            assert logger.incidents["routing_buffer_changed"]["count"] == 1
            assert "step 0" in logger.incidents["routing_buffer_changed"]["first"]
            want = second["engine_experts"].copy()
            held_writer.clear()
            logger.log_step(1, tokens=second)  # copied at the call from now on
            second["engine_experts"][:] = 0
            held_writer.set()
    assert any(issubclass(w.category, LogWarning) and "routing_buffer_changed" in str(w.message) for w in caught)
    lists, agreement, mu = logged(tmp_path, "r", 0)
    assert lists and all(v is None for v in lists) and all(a is None for a in agreement)
    assert np.allclose(mu, first["mu_logprob"].reshape(-1))  # the call's other columns are kept
    lists, agreement, _ = logged(tmp_path, "r", 1)
    assert np.array_equal(np.array(lists).reshape(want.shape), want)
    assert all(a is not None for a in agreement)


def test_copy_routing_copies_at_the_call(tmp_path, held_writer):
    rng = np.random.default_rng(2)
    tokens = one_step(rng)
    want = tokens["engine_experts"].copy()
    with TokenLogger(tmp_path, "r", routing_shape=SHAPE, routing_fraction=1.0, copy_routing=True) as logger:
        logger.log_step(0, tokens=tokens)
        tokens["engine_experts"][:] = 0
        held_writer.set()
    lists, _, _ = logged(tmp_path, "r", 0)
    assert np.array_equal(np.array(lists).reshape(want.shape), want)
    assert not logger.incidents


def test_masked_rows_are_gathered_on_the_writer_thread(tmp_path, held_writer):
    """A padded call's lent lists: the mask's rows, gathered by the writer, in order."""
    rng = np.random.default_rng(3)
    tokens = one_step(rng, 4, 8)
    mask = np.ones((4, 8), bool)
    mask[1, 5:] = mask[3, 2:] = False
    with TokenLogger(tmp_path, "r", routing_shape=SHAPE, routing_fraction=1.0) as logger:
        logger.log_step(0, tokens=tokens, mask=mask)
        held_writer.set()
    t = rows(tmp_path, "r")
    got = {(s, p): v for s, p, v in zip(t["sample_id"], t["pos"], t["engine_experts"], strict=True)}
    assert len(got) == mask.sum()
    for b, p in zip(*np.nonzero(mask), strict=True):
        assert np.array_equal(np.array(got[(b, p)]), tokens["engine_experts"][b, p].reshape(-1))


def test_a_handed_off_buffer_is_kept_without_a_copy_or_a_guard(tmp_path, held_writer):
    """handoff(): the caller says it will not touch the buffer again, so no guard reads it: what the writer reads
    is what is written (here a change the test makes on purpose shows that nothing was copied)."""
    rng = np.random.default_rng(4)
    tokens = one_step(rng)
    buffer = tokens["engine_experts"]
    tokens["engine_experts"] = handoff(buffer)
    with TokenLogger(tmp_path, "r", routing_shape=SHAPE, routing_fraction=1.0) as logger:
        logger.log_step(0, tokens=tokens)
        buffer[:] = 7
        held_writer.set()
    lists, _, _ = logged(tmp_path, "r", 0)
    assert np.all(np.array(lists) == 7)
    assert not logger.incidents
