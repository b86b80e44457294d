"""``trustscope doctor``: every check on a log built to fail it and on a clean one, the CLI's exit codes, the
dashboard's Doctor section.

Logs are written through the real :class:`trustscope.logger.TokenLogger` from a small model of an engine and a
trainer: each position has logits over V ids; the engine samples from softmax(logits / T) and reports that
distribution's log-probs and top-K (the sampled id forced into the K-th slot), the trainer's pi is the softmax of
slightly perturbed logits at its own temperature. A test changes one thing the way a broken integration would.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from trustscope import doctor as D
from trustscope.cli import app
from trustscope.db import connect
from trustscope.logger import TokenLogger

B, T, K, V = 16, 12, 4, 64
STEPS = 2


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def make_step(rng: np.random.Generator, *, temperature: float = 1.0, pi_temperature: float | None = None,
              force_sampled: bool = True, drift: float = 0.05) -> dict[str, np.ndarray]:
    """One step's token columns ``(B, T)`` / ``(B, T, K)``: engine at ``temperature``, trainer at
    ``pi_temperature`` (default the same) on logits moved by noise of scale ``drift``."""
    logits = rng.normal(0, 2.0, size=(B, T, V))  # (B, T, V)
    q = _log_softmax(logits / temperature)  # (B, T, V) engine log-probs
    p = _log_softmax((logits + rng.normal(0, drift, size=logits.shape)) / (pi_temperature or temperature))
    cdf = np.exp(q).cumsum(axis=-1)
    token = np.minimum((rng.uniform(size=(B, T, 1)) > cdf).sum(axis=-1), V - 1)  # (B, T)
    ids = np.argsort(-q, axis=-1)[..., :K]  # (B, T, K)
    if force_sampled:
        absent = ~(ids == token[..., None]).any(axis=-1)
        ids[..., K - 1] = np.where(absent, token, ids[..., K - 1])
    take = np.take_along_axis
    return {
        "token_id": token.astype(np.int32),
        "mu_logprob": take(q, token[..., None], -1)[..., 0].astype(np.float32),
        "pi_logprob": take(p, token[..., None], -1)[..., 0].astype(np.float32),
        "old_logprob": take(p, token[..., None], -1)[..., 0].astype(np.float32),
        "advantage": np.repeat(rng.choice([-1.0, 1.0], size=(B, 1)), T, axis=1).astype(np.float32),
        "mu_topk_ids": ids.astype(np.int32),
        "mu_topk_logprobs": take(q, ids, -1).astype(np.float32),
        "pi_topk_logprobs": take(p, ids, -1).astype(np.float32),
        "kept": np.ones((B, T), dtype=bool),
    }


TURNS = np.repeat(np.arange(3), T // 3).astype(np.int32)  # (T,) three model turns of T / 3 tokens each


REPLACED = 0.05
"""The share of the router's own (layer, slot) choices a clean replayed run's replay replaces."""


def _router_pick(rng: np.random.Generator, engine: np.ndarray, share: float = REPLACED) -> np.ndarray:
    """The router's own pick under replay: ``engine`` ``(B, T, L, k)`` with ``share`` of the choices another expert
    outside the layer's set (the engine's experts replaced them)."""
    own = engine.copy()
    flat = own.reshape(-1, own.shape[-1])  # (rows, k)
    for row, slots in zip(flat, rng.random(flat.shape) < share, strict=True):
        row[slots] = rng.permutation(np.setdiff1d(np.arange(4), row))[:slots.sum()]  # top-2 of 4: 2 outside
    return own


def write_log(root: Path, run_id: str = "run", *, breaks=None, sampling=None, mu_source: str = "engine",
              ranks: int = 1, sample_offsets: bool = True, drop: tuple[str, ...] = (), seed: int = 0,
              steps: int = STEPS, multi_turn: bool = False, max_staleness: int | None = None,
              equal_rewards: bool = False, replayed: bool = False, replaced: float = REPLACED,
              **step_options) -> Path:
    """A log of ``steps`` steps per rank; ``breaks(step_columns[, step=step])`` edits each step's columns in place.
    ``multi_turn``: each response has three turns, half the responses were sampled a version behind
    (``policy_version``), and the engine's token ids are logged; ``equal_rewards``: every group's rewards equal;
    ``replayed``: a mixture-of-experts run declared replayed, both sides' experts logged and equal, and the trainer
    router's own pick (``router_experts``) replaced by the engine's on ``replaced`` of the choices."""
    rng = np.random.default_rng(seed)
    rewards = np.random.default_rng(seed + 1000)
    replace = np.random.default_rng(seed + 2000)
    sampling = {"temperature": step_options.get("temperature", 1.0), "top_p": 1.0} if sampling is None else sampling
    loggers = [TokenLogger(root, run_id, sampling=sampling, vocab=[f"t{i}" for i in range(V)] if r == 0 else None,
                           loss_rule="ppo_clip", mu_source=mu_source, rank=r, fsync=False,
                           max_staleness=max_staleness,
                           **({"routing_shape": (2, 2, 4), "routing_replay": True} if replayed else {}))
               for r in range(ranks)]
    for step in range(steps):
        for r, logger in enumerate(loggers):
            cols = make_step(rng, **step_options)
            if multi_turn:
                cols["turn"] = np.tile(TURNS, (B, 1))
                cols["policy_version"] = np.where(np.arange(B) % 2, step, max(step - 1, 0))
                cols["engine_token_id"] = cols["token_id"].copy()
            if replayed:
                cols["engine_experts"] = np.stack([rng.permutation(4)[:2] for _ in range(B * T * 2)]).reshape(
                    B, T, 2, 2)
                cols["trainer_experts"] = cols["engine_experts"][..., ::-1].copy()  # order within a layer is free
                cols["router_experts"] = _router_pick(replace, cols["engine_experts"], replaced)
            if breaks is not None:
                breaks(cols, **({"step": step} if "step" in inspect.signature(breaks).parameters else {}))
            sample_id = np.arange(B) + (r * B if sample_offsets else 0)
            reward = np.zeros(B, np.float32) if equal_rewards else rewards.random(B).astype(np.float32)
            logger.log_step(step, tokens={k: v for k, v in cols.items() if k not in drop},
                            mask=np.ones((B, T), dtype=bool),
                            samples={"sample_id": sample_id, "prompt_id": sample_id // 4, "reward": reward})
    for logger in loggers:
        logger.close()
    return root / run_id


# ------------------------------------------------------------------------------------------------ the breaks


def _pi_one_position_late(cols):
    cols["pi_logprob"][:, 1:] = cols["pi_logprob"][:, :-1].copy()


def _mu_one_position_late(cols):
    cols["mu_logprob"][:, 1:] = cols["mu_logprob"][:, :-1].copy()


def _padding_tail(cols, kept=True):
    # The last 3 positions of every other response are padding: id 0, the engine's filler log-prob 0.
    cols["token_id"][::2, -3:] = 0
    cols["mu_logprob"][::2, -3:] = 0.0
    cols["pi_logprob"][::2, -3:] = -12.0
    cols["kept"][::2, -3:] = kept


def _blocked_padding_tail(cols):
    _padding_tail(cols, kept=False)


def _minus_inf_stand_in(cols):
    cols["mu_logprob"][0, 5] = -1e4


def _mu_mass_above_one(cols):
    cols["mu_topk_logprobs"][3, 4] = np.log([0.6, 0.3, 0.2, 0.1])  # sums to 1.2


def _pi_mass_above_one(cols):
    cols["pi_topk_logprobs"][3, 4] = np.log([0.6, 0.3, 0.2, 0.1])


def _mass_within_float16_rounding(cols):
    lp = cols["mu_topk_logprobs"]
    lp[:] = np.log(np.full(lp.shape, 1.0 / K) * (1 + 2e-3))  # 0.2 % over, within the tolerance


def _duplicate_id(cols):
    cols["mu_topk_ids"][2, 7, 1] = cols["mu_topk_ids"][2, 7, 0]


def _top_p_renormalised(cols):
    cols["mu_logprob"] += np.float32(-np.log(0.8))  # top_p's renormalisation over a nucleus of mass 0.8
    np.minimum(cols["mu_logprob"], 0.0, out=cols["mu_logprob"])


def _nucleus_floor(cols):
    # What the engine writes for top-K ids outside the top-p nucleus: a finite floor (engines.base.LOGPROB_FLOOR).
    outside = cols["mu_topk_ids"] != cols["token_id"][..., None]
    outside[..., :2] = False
    cols["mu_topk_logprobs"][outside] = -1e4


def _mu_is_pi(cols):
    cols["mu_logprob"][:] = cols["pi_logprob"]


def _mu_is_pi_to_rounding(cols):
    # A second forward of the same weights: equal to a few float32 ulps, rarely bit for bit.
    cols["mu_logprob"][:] = cols["pi_logprob"] - np.float32(5e-7)


def _pi_late_from_the_last_turn(cols):
    # A separator dropped where the last turn begins: from there on the trainer's positions are one behind.
    start = int(np.flatnonzero(TURNS == 2)[0])
    cols["pi_logprob"][:, start + 1:] = cols["pi_logprob"][:, start:-1].copy()


def _environment_padded_with_zero(cols):
    # The middle turn is the environment's answer, its engine log-probs padded with 0.0, left in the mask.
    cols["mu_logprob"][:, TURNS == 1] = 0.0


def _sampled_under_version_zero(cols, *, step):
    cols["policy_version"][:] = 0


def _retokenized(cols):
    # A re-rendered history: two responses' ids change at the second turn's first token.
    start = int(np.flatnonzero(TURNS == 1)[0])
    cols["token_id"][:2, start] = (cols["engine_token_id"][:2, start] + 1) % V


def _replay_buffer_one_position_off(cols):
    """The trainer replayed the engine's experts one position late: what a misaligned replay buffer does."""
    cols["trainer_experts"] = np.roll(cols["engine_experts"], 1, axis=1)


NO_TOPK = ("mu_topk_ids", "mu_topk_logprobs", "pi_topk_logprobs")

VARIANTS: dict[str, dict] = {
    "clean": {"temperature": 0.7, "ranks": 2, "multi_turn": True, "max_staleness": 1, "replayed": True},
    "clean_t1": {},
    "no_topk": {"drop": NO_TOPK},
    "pi_late": {"breaks": _pi_one_position_late},
    "mu_late": {"breaks": _mu_one_position_late},
    "padding": {"breaks": _padding_tail},
    "padding_blocked": {"breaks": _blocked_padding_tail},
    "minus_inf": {"breaks": _minus_inf_stand_in},
    "sampled_not_forced": {"force_sampled": False},
    "mu_mass": {"breaks": _mu_mass_above_one},
    "pi_mass": {"breaks": _pi_mass_above_one},
    "mass_rounding": {"breaks": _mass_within_float16_rounding},
    "duplicate": {"breaks": _duplicate_id},
    "processed": {"temperature": 0.7, "pi_temperature": 1.0},
    "drifted": {"temperature": 0.7, "drift": 0.5, "drop": ("old_logprob",)},
    # The mean gap's z-score grows with the token count: these read 3x the steps.
    "processed_no_topk": {"temperature": 0.7, "pi_temperature": 1.0, "drop": NO_TOPK, "steps": 3 * STEPS},
    "processed_no_topk_no_old": {"temperature": 0.7, "pi_temperature": 1.0, "drop": ("old_logprob", *NO_TOPK),
                                 "steps": 3 * STEPS},
    "top_p": {"breaks": _top_p_renormalised, "sampling": {"temperature": 1.0, "top_p": 0.9}, "drop": NO_TOPK,
              "steps": 3 * STEPS},
    "no_sampling": {"sampling": {}},
    "nucleus_floor": {"temperature": 0.7, "breaks": _nucleus_floor},
    "mu_is_pi": {"breaks": _mu_is_pi},
    "mu_is_pi_declared": {"breaks": _mu_is_pi, "mu_source": "trainer_recompute"},
    "mu_is_pi_to_rounding": {"breaks": _mu_is_pi_to_rounding},
    "rank_collisions": {"ranks": 2, "sample_offsets": False},
    "turn_shift": {"multi_turn": True, "breaks": _pi_late_from_the_last_turn},
    "env_padded": {"multi_turn": True, "breaks": _environment_padded_with_zero},
    "stale": {"multi_turn": True, "max_staleness": 1, "breaks": _sampled_under_version_zero, "steps": 3},
    "retokenized": {"multi_turn": True, "breaks": _retokenized},
    "equal_rewards": {"equal_rewards": True},
    "replay_corrupted": {"replayed": True, "breaks": _replay_buffer_one_position_off},
    "replay_drifted": {"replayed": True, "replaced": 0.7},
}
"""One run per variant, all in one log directory: a clean log, and logs each broken the way an integration breaks."""


@pytest.fixture(scope="module")
def doctored(tmp_path_factory) -> dict[str, dict[str, D.Finding]]:
    """Every variant's findings: {variant: {check: Finding}}, from one diagnose over one log directory."""
    root = tmp_path_factory.mktemp("doctor")
    for seed, (name, options) in enumerate(VARIANTS.items()):
        write_log(root, name, seed=seed, **options)
    with connect(root, cache=False) as db:
        found = D.diagnose(db)
    assert sorted(found) == sorted(VARIANTS)
    return {run: {f.check: f for f in fs} for run, fs in found.items()}


# ------------------------------------------------------------------------------------------------ clean logs


def test_clean_log_passes_every_check(doctored):
    got = doctored["clean"]
    assert list(got) == list(D.CHECKS)
    assert {name: f.verdict for name, f in got.items()} == dict.fromkeys(D.CHECKS, "ok"), got
    assert got["routing_replace_rate"].evidence["replace_rate"] == pytest.approx(REPLACED, abs=0.02)
    assert got["routing_fallbacks"].evidence["n_fallback"] == 0


def test_clean_log_at_temperature_one_skips_what_cannot_apply(doctored):
    got = doctored["clean_t1"]
    assert got["processed_logprobs"].verdict == "skipped"
    assert "temperature 1" in got["processed_logprobs"].summary
    assert got["rank_collisions"].verdict == "skipped"
    unlogged = {"turn_alignment": "no turns", "staleness_bound": "no policy_version", "token_drift": "no engine_token_id",
                "routing_replay": "not declared replayed", "cause_staleness": "needs `policy_version`",
                "cause_token_drift": "needs `engine_token_id`", "cause_routing": "needs `routing_agreement`",
                "routing_replace_rate": "no router's own pick", "routing_fallbacks": "no routed experts",
                "routing_alignment": "no routed experts"}
    for name, reason in unlogged.items():  # what a single-turn, synchronous run does not log
        assert got[name].verdict == "skipped" and reason in got[name].summary, name
    assert all(f.verdict == "ok" for name, f in got.items()
               if name not in ("processed_logprobs", "rank_collisions", *unlogged))


def test_log_without_topk_skips_the_topk_checks_with_a_reason(doctored):
    got = doctored["no_topk"]
    for name in ("topk_sampled", "topk_mass", "topk_duplicates"):
        assert got[name].verdict == "skipped" and "no top-K" in got[name].summary


def test_one_broken_run_leaves_the_others_alone(doctored):
    # Each variant breaks one thing; the checks it does not concern stay ok or skipped on it.
    for check in ("topk_mass", "topk_duplicates", "rank_collisions"):
        assert doctored["pi_late"][check].verdict in ("ok", "skipped")
    assert doctored["duplicate"]["topk_sampled"].verdict == "ok"
    assert doctored["rank_collisions"]["alignment"].verdict == "ok"


# ------------------------------------------------------------------------------------------------ broken logs


def test_a_shift_from_a_turn_boundary_fails_turn_alignment_not_alignment(doctored):
    """pi one position late from the last turn on: the whole-response average hides it, the per-turn judgement
    names the turn."""
    assert doctored["turn_shift"]["alignment"].verdict == "ok"
    f = doctored["turn_shift"]["turn_alignment"]
    assert f.verdict == "fail" and f.summary.startswith("turn(s) 2 of 3") and "one position later" in f.summary
    assert "starts at a turn boundary" in f.cause
    assert f.evidence["diff_best_shift_turn2"] < D.ALIGN_FACTOR * f.evidence["diff_logged_turn2"]
    assert all(ex["turn"] == 2 and {"step", "sample_id", "pos"} <= set(ex) for ex in f.examples)
    assert doctored["clean"]["turn_alignment"].verdict == "ok"


def test_zero_padded_environment_logprobs_fail_turn_placeholders(doctored):
    f = doctored["env_padded"]["turn_placeholders"]
    assert f.verdict == "fail" and "most in turn 1" in f.summary and "mu's log-prob at exactly 0.0" in f.summary
    assert f.evidence["n_flagged_turn1"] >= D.PADDED_MIN and "n_flagged_turn0" not in f.evidence
    assert all(ex["turn"] == 1 and ex["mu_logprob"] == 0.0 for ex in f.examples)
    assert doctored["clean"]["turn_placeholders"].verdict == "ok"


def test_tokens_older_than_the_declared_bound_fail_staleness_bound(doctored):
    f = doctored["stale"]["staleness_bound"]
    assert f.verdict == "fail" and f.evidence["bound"] == 1 and f.evidence["max_staleness"] == 2
    assert f.evidence["n_over_bound"] == B * T  # step 2's tokens, all sampled under version 0
    assert all(ex["staleness"] == 2 and ex["policy_version"] == 0 for ex in f.examples)
    assert doctored["clean"]["staleness_bound"].verdict == "ok"
    assert doctored["turn_shift"]["staleness_bound"].verdict == "skipped"  # no bound declared
    assert "no staleness bound declared" in doctored["turn_shift"]["staleness_bound"].summary


def test_engine_ids_that_differ_from_the_trainers_fail_token_drift(doctored):
    f = doctored["retokenized"]["token_drift"]
    assert f.verdict == "fail" and f.evidence["n_differ"] == 2 * STEPS and f.evidence["n_differ_turn1"] == 2 * STEPS
    assert all(ex["token_id"] != ex["engine_token_id"] and ex["turn"] == 1 for ex in f.examples)
    assert doctored["clean"]["token_drift"].verdict == "ok"


def test_groups_with_equal_rewards_warn(doctored):
    f = doctored["equal_rewards"]["zero_variance_groups"]
    assert f.verdict == "warn" and f.evidence["share_zero_variance"] == 1.0 and f.examples
    assert {"step", "prompt_id", "reward", "n_responses"} <= set(f.examples[0])
    assert doctored["clean"]["zero_variance_groups"].verdict == "ok"


@pytest.mark.parametrize(("variant", "direction"), [("pi_late", "later"), ("mu_late", "earlier")])
def test_alignment_fails_when_mu_and_pi_are_off_by_one(doctored, variant, direction):
    f = doctored[variant]["alignment"]
    assert f.verdict == "fail"
    assert f"one position {direction}" in f.cause
    assert f.evidence[f"diff_pi_{direction}"] < D.ALIGN_FACTOR * f.evidence["diff_logged"]
    assert {"step", "sample_id", "pos"} <= set(f.examples[0])


@pytest.mark.parametrize(("variant", "kept", "verdict"), [("padding", True, "fail"),
                                                          ("padding_blocked", False, "warn")])
def test_placeholders_flag_padding_that_leaked_in(doctored, variant, kept, verdict):
    f = doctored[variant]["placeholders"]
    assert f.verdict == verdict
    n = STEPS * (B // 2) * 3
    assert f.evidence["n_flagged"] == n
    assert f.evidence["n_flagged_kept"] == (n if kept else 0)
    assert f.evidence["n_flagged_at_end"] == STEPS * (B // 2)
    assert f.evidence["n_mu_placeholder"] == n
    assert all(ex["mu_logprob"] == 0.0 and ex["pos"] >= T - 3 for ex in f.examples)
    assert "padding" in f.cause


def test_placeholders_flag_minus_inf_stand_ins(doctored):
    f = doctored["minus_inf"]["placeholders"]
    assert f.verdict == "fail" and f.evidence["n_flagged"] == STEPS
    assert f.examples[0]["pos"] == 5 and f.examples[0]["sample_id"] == 0


def test_placeholders_only_warn_when_they_are_a_handful_in_a_million():
    m = {"n_tokens": 1_000_000, "n_flagged": 5, "n_flagged_kept": 4, "n_flagged_at_end": 0, "n_mu_placeholder": 0,
         "n_pi_placeholder": 5, "examples": []}
    f = D.judge_placeholders(m)
    assert f.verdict == "warn" and "genuine extremes" in f.cause
    assert D.judge_placeholders({**m, "n_flagged": 100, "n_flagged_kept": 100}).verdict == "fail"


def test_topk_sampled_fails_when_the_sampled_token_is_not_forced_in(doctored):
    f = doctored["sampled_not_forced"]["topk_sampled"]
    assert f.verdict == "fail" and f.evidence["n_missing_sampled"] > 0
    ex = f.examples[0]
    assert ex["token_id"] not in ex["mu_topk_ids"]


@pytest.mark.parametrize(("variant", "side"), [("mu_mass", "mu"), ("pi_mass", "pi")])
def test_topk_mass_fails_when_a_list_sums_above_one(doctored, variant, side):
    f = doctored[variant]["topk_mass"]
    assert f.verdict == "fail"
    assert f.evidence[f"n_{side}_over"] == STEPS
    assert f.evidence[f"{side}_mass_max"] == pytest.approx(1.2, abs=1e-5)
    assert (f.examples[0]["sample_id"], f.examples[0]["pos"]) == (3, 4)


def test_topk_mass_tolerates_float16_rounding(doctored):
    assert doctored["mass_rounding"]["topk_mass"].verdict == "ok"


def test_topk_duplicates_fail_when_an_id_repeats(doctored):
    f = doctored["duplicate"]["topk_duplicates"]
    assert f.verdict == "fail" and f.evidence["n_duplicates"] == STEPS
    assert (f.examples[0]["sample_id"], f.examples[0]["pos"]) == (2, 7)


def test_processed_logprobs_fail_when_mu_is_after_temperature_and_pi_raw(doctored):
    f = doctored["processed"]["processed_logprobs"]
    assert f.verdict == "fail"
    assert f.evidence["topk_slope"] == pytest.approx(1 / 0.7, rel=0.05)
    assert f.evidence["mean_log_gap"] > D.BIAS_NATS
    assert "temperature 0.7" in f.cause


def test_processed_logprobs_ok_when_pi_drifted_at_the_same_temperature(doctored):
    # A pi far from mu raises the mean gap (KL(mu || pi)), but the top-K slope stays at or below 1 (noise in pi
    # spreads pi's log-probs at mu's top ids), far from 1 / 0.7: not a processing mismatch.
    f = doctored["drifted"]["processed_logprobs"]
    assert f.evidence["mean_log_gap"] > D.BIAS_NATS and f.evidence["z"] > D.BIAS_Z
    assert f.evidence["topk_slope"] < 1.0
    assert f.verdict == "ok"


def test_processed_logprobs_fail_on_the_mean_gap_against_pi_old_without_topk(doctored):
    f = doctored["processed_no_topk"]["processed_logprobs"]
    assert f.verdict == "fail" and f.evidence["topk_slope"] is None
    assert f.evidence["z"] > D.BIAS_Z


def test_processed_logprobs_only_warn_on_the_mean_gap_against_a_pi_that_moved(doctored):
    f = doctored["processed_no_topk_no_old"]["processed_logprobs"]
    assert f.verdict == "warn" and "pi_old" in f.cause


def test_processed_logprobs_fail_under_top_p(doctored):
    f = doctored["top_p"]["processed_logprobs"]
    assert f.verdict == "fail" and "top_p 0.9" in f.summary


def test_processed_logprobs_leave_floored_topk_entries_out_of_the_slope(doctored):
    f = doctored["nucleus_floor"]["processed_logprobs"]
    assert f.evidence["topk_slope"] == pytest.approx(1.0, abs=0.05)
    assert f.verdict == "ok"


def test_processed_logprobs_skipped_without_sampling_parameters(doctored):
    f = doctored["no_sampling"]["processed_logprobs"]
    assert f.verdict == "skipped" and "no sampling" in f.summary


def test_processed_logprobs_names_a_bad_sampling_value_and_skips_greedy_decoding():
    m = {"n_tokens": 100, "n_ref_old": 0, "mean_log_gap": 0.5, "sd_log_gap": 0.1, "n_topk_rows": 0,
         "topk_slope": None, "examples": []}
    with pytest.raises(ValueError, match=r"sampling\.temperature='hot'"):
        D.judge_processed_logprobs(m, {"temperature": "hot"})
    with pytest.raises(ValueError, match=r"sampling='t=0\.7' must be an object"):
        D.judge_processed_logprobs(m, "t=0.7")
    greedy = D.judge_processed_logprobs(m, {"temperature": 0.0})
    assert greedy.verdict == "skipped" and "greedy" in greedy.summary


def test_mu_recompute_fails_when_mu_equals_pi_undeclared(doctored):
    f = doctored["mu_is_pi"]["mu_recompute"]
    assert f.verdict == "fail"
    assert f.evidence["n_same_pi"] == f.evidence["n_informative"] > D.MIN_TOKENS
    assert "recompute" in f.cause


def test_mu_recompute_warns_when_mu_agrees_to_float32_rounding(doctored):
    f = doctored["mu_is_pi_to_rounding"]["mu_recompute"]
    assert f.verdict == "warn" and "float32 rounding" in f.cause
    assert f.evidence["n_exact_pi"] < D.RECOMPUTE_SHARE * f.evidence["n_informative"] <= f.evidence["n_same_pi"]


def test_mu_recompute_warns_when_run_json_declares_it(doctored):
    f = doctored["mu_is_pi_declared"]["mu_recompute"]
    assert f.verdict == "warn" and "trainer_recompute" in f.cause


def test_rank_collisions_fail_when_ranks_count_from_zero(doctored):
    f = doctored["rank_collisions"]["rank_collisions"]
    assert f.verdict == "fail"
    assert f.evidence["n_token_collisions"] == f.evidence["n_sample_collisions"] == STEPS * B
    assert f.examples[0]["ranks"] == [0, 1]


# ------------------------------------------------------------------------------------------------ the registry


def test_every_doctor_sql_file_is_read_by_a_check():
    files = {p.name for p in D.DOCTOR_SQL_DIR.glob("*.sql")}
    assert files == {check.sql for check in D.CHECKS.values()}


def test_a_check_is_declared_once_and_names_a_file_that_exists():
    with pytest.raises(ValueError, match="'alignment' is declared twice"):
        D.register_check("alignment", sql="alignment.sql", about="again")(D.judge_alignment)
    with pytest.raises(ValueError, match=r"no nowhere\.sql in"):
        D.register_check("nowhere", sql="nowhere.sql", about="a file that is not there")(D.judge_alignment)
    assert "nowhere" not in D.CHECKS


def test_findings_carry_the_name_they_were_declared_under(doctored):
    assert all(name == f.check for found in doctored.values() for name, f in found.items())


# ------------------------------------------------------------------------------------------------ the CLI


def test_cli_help_lists_every_check():
    result = CliRunner().invoke(app, ["doctor", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the help is wrapped
    for check in D.CHECKS.values():
        assert f"{check.name} ({check.about})" in text


def test_cli_exit_codes(tmp_path):
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    write_log(clean, temperature=0.7, ranks=2, multi_turn=True, max_staleness=1, replayed=True)
    write_log(broken, breaks=_pi_one_position_late)
    runner = CliRunner()
    ok = runner.invoke(app, ["doctor", str(clean)])
    assert ok.exit_code == 0, ok.output
    assert "[OK] alignment" in ok.output and f"1 run(s): {len(D.CHECKS)} ok, 0 warn, 0 fail, 0 skipped" in ok.output
    bad = runner.invoke(app, ["doctor", str(broken)])
    assert bad.exit_code == 1
    assert "[FAIL] alignment" in bad.output and "likely cause:" in bad.output and "e.g. step=" in bad.output
    missing = runner.invoke(app, ["doctor", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2
    unknown = runner.invoke(app, ["doctor", str(clean), "--run", "nope"])
    assert unknown.exit_code == 2 and "nope" in unknown.output
    torn = tmp_path / "torn"
    write_log(torn)
    tokens_file = next((torn / "run" / "tokens").rglob("*.parquet"))
    tokens_file.write_bytes(tokens_file.read_bytes()[:300])  # a file cut short
    unreadable = runner.invoke(app, ["doctor", str(torn)])
    assert unreadable.exit_code == 2 and "cannot read" in unreadable.output and "validate" in unreadable.output
    odd = tmp_path / "odd"
    write_log(odd, sampling={"temperature": "hot"})
    bad_manifest = runner.invoke(app, ["doctor", str(odd)])
    assert bad_manifest.exit_code == 2 and "run 'run': run.json sampling.temperature='hot'" in bad_manifest.output
    late = runner.invoke(app, ["doctor", str(broken), "--from-step", str(STEPS - 1)])
    assert late.exit_code == 1 and f"n_tokens={B * T}," in late.output  # one step of B x T tokens read


def test_doctor_panel_rows(tmp_path):
    write_log(tmp_path, "a", breaks=_mu_is_pi)
    write_log(tmp_path, "b")
    with connect(tmp_path, cache=False) as db:
        panel = D.doctor_panel(db, "a")
        assert list(panel.columns) == ["run_id", "check", "verdict", "summary", "cause", "examples"]
        assert panel["check"].tolist() == list(D.CHECKS)
        row = panel.set_index("check").loc["mu_recompute"]
        assert row["verdict"] == "fail" and '"step"' in row["examples"]
    both = D.doctor_panel(tmp_path, ["a", "b"]).set_index(["run_id", "check"])["verdict"]
    assert (both["a", "mu_recompute"], both["b", "mu_recompute"]) == ("fail", "ok")


def test_runs_page_shows_the_doctor_section(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from app.launch import LOGDIR_ENV

    write_log(tmp_path, "broken", breaks=_pi_one_position_late)
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app" / "main.py"), default_timeout=60)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert "Doctor" in [h.value for h in at.subheader]
    table = at.dataframe[-1].value  # the last table of the page
    assert sorted(table["check"]) == sorted(D.CHECKS)
    assert table.iloc[0][["check", "verdict"]].tolist() == ["alignment", "fail"]  # failures first
    assert any("1 fail" in c.value for c in at.caption)


@pytest.mark.slow
def test_imported_runs_pass(tmp_path):
    # Each importer's run, from files shaped as the frameworks' own writers write them (the importers' fixtures).
    from test_importers_nemo_rl import write_log_dir
    from test_importers_prime_rl import write_export
    from test_importers_slime import write_dump

    from trustscope.importers import import_run

    writers = {"prime-rl": lambda p: write_export(p, steps=2), "miles": lambda p: write_dump(p, steps=2, tp=1, pp=1),
               "slime": lambda p: write_dump(p, steps=2, kind="slime"), "nemo-rl": lambda p: write_log_dir(p, steps=2)}
    for fmt, write in writers.items():
        write(tmp_path / fmt)
        import_run(fmt, tmp_path / fmt, tmp_path / "logs", run_id=fmt)
    found = D.doctor_logdir(tmp_path / "logs")
    assert sorted(found) == sorted(writers)
    assert {f.verdict for fs in found.values() for f in fs} <= {"ok", "skipped"}, found
    assert all(fs[0].check == "alignment" and fs[0].verdict == "ok" for fs in found.values())


def test_sample_logs_pass():
    root = Path(__file__).resolve().parent.parent / "sample_logs"
    found = D.doctor_logdir(root)
    assert found and D.failed(found) == 0, {r: [f for f in fs if f.verdict == "fail"] for r, fs in found.items()}


def test_replayed_run_with_a_misaligned_replay_buffer_fails(doctored):
    got = doctored["replay_corrupted"]["routing_replay"]
    assert got.verdict == "fail" and got.evidence["n_routed"] == got.evidence["n_tokens"]
    assert 0 < got.evidence["n_disagree"] <= got.evidence["n_routed"] and 0 < got.evidence["choice_disagreement"] < 1
    assert len(got.examples) == 3 and all(e["routing_agreement"] < 1 for e in got.examples)
    assert "misaligned" in got.cause
    assert doctored["clean"]["routing_replay"].evidence["n_disagree"] == 0


def test_a_replay_that_replaces_most_of_the_routers_choices_warns(doctored):
    got = doctored["replay_drifted"]["routing_replace_rate"]
    assert got.verdict == "warn" and got.evidence["replace_rate"] == pytest.approx(0.7, abs=0.03)
    assert got.evidence["replace_rate"] > D.REPLACE_RATE_WARN and "replaced" in got.cause
    assert {f"replace_rate_layer{layer}" for layer in range(2)} <= set(got.evidence)
    assert [e["step"] for e in got.examples] and all(e["replace_rate"] > D.REPLACE_RATE_WARN for e in got.examples)
    assert doctored["replay_drifted"]["routing_replay"].verdict == "ok"  # the experts used are the engine's
