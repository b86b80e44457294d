"""trustscope.losses: every rule against the paper's examples, a slow float64 reference, gradients, bf16, errors."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from trustscope import divergence as D
from trustscope import losses as L
from trustscope.losses import LossOutput, PolicyBatch, get_loss, list_losses, register_loss
from trustscope.masks import family

RULES = sorted(n for n in L.BUILTIN_RULES if not get_loss(n).sql.sequence and get_loss(n).weight is L.weight_is)
"""Token-level hard-mask rules: a token's mask reads only that token; the weight is the (capped) pi/mu."""
SEQUENCE_RULES = sorted(n for n in L.BUILTIN_RULES if get_loss(n).sql.sequence)
"""Rules whose mask reads the whole response."""
NEVER_BLOCK = tuple(sorted(n for n in L.BUILTIN_RULES if get_loss(n).sql.family == "none"))
"""Rules without a trust region (their mask keeps every token)."""


def batch_of(pi: list[float], mu: list[float], adv: list[float], *, old: list[float] | None = None,
             dtype: torch.dtype = torch.float64, grad: bool = False) -> PolicyBatch:
    """One sequence of tokens given by probabilities; top-K = the sampled token alone (K = 1)."""

    def t(p: list[float]) -> torch.Tensor:
        return torch.tensor([[math.log(x) for x in p]], dtype=torch.float64).to(dtype)

    pi_lp = t(pi).requires_grad_(grad)
    return PolicyBatch(
        pi_logprob=pi_lp, mu_logprob=t(mu), advantages=torch.tensor([adv], dtype=dtype),
        mask=torch.ones(1, len(pi), dtype=torch.bool), old_logprob=t(old) if old else t(mu),
        mu_topk_logprobs=t(mu)[..., None], pi_topk_logprobs=pi_lp.detach()[..., None],
    )


# --- the paper's worked examples -----------------------------------------------------------------------------------


def test_paper_defaults():
    assert {"ppo_clip", "dppo_binary_tv", "dppo_topk_kl", "minirl"} <= set(RULES)
    assert set(SEQUENCE_RULES) == {"gspo", "geo_mask", "cppo"} and set(NEVER_BLOCK) == {"pg_is", "cispo", "token_tis"}
    assert get_loss("dppo_binary_tv").defaults["delta"] == 0.15
    assert get_loss("dppo_topk_tv").defaults["delta"] == 0.15
    assert get_loss("dppo_binary_kl").defaults["delta"] == 0.05
    assert get_loss("dppo_topk_kl").defaults["delta"] == 0.05
    assert get_loss("ppo_clip").defaults["eps_low"] == 0.2
    assert get_loss("ppo_clip").defaults["eps_high"] == 0.28
    assert get_loss("grpo").defaults["eps_high"] == 0.2
    assert get_loss("ppo_lowprob_relax").defaults["alpha_low"] == 0.1
    assert get_loss("minimal_negative_mask").defaults["delta"] == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rare_token_pushed_up(dtype):
    b = batch_of([1e-2], [1e-4], [1.0], dtype=dtype)
    assert not get_loss("ppo_clip")(b).keep.item()
    assert not get_loss("grpo")(b).keep.item()
    for name in ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl"):
        assert get_loss(name)(b).keep.item(), name
    assert get_loss("ppo_lowprob_relax")(b).keep.item()  # mu < alpha: the clip is lifted
    assert D.binary_tv(b.mu_logprob, b.pi_logprob).item() == pytest.approx(0.0099, abs=1e-6)
    assert D.binary_kl(b.mu_logprob, b.pi_logprob).item() == pytest.approx(0.0095, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_token_pushed_down(dtype):
    b = batch_of([0.80], [0.99], [-1.0], dtype=dtype)
    assert get_loss("ppo_clip")(b).keep.item()
    for name in ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl"):
        assert not get_loss(name)(b).keep.item(), name
    assert D.binary_tv(b.mu_logprob, b.pi_logprob).item() == pytest.approx(0.19, abs=1e-6)
    assert D.binary_kl(b.mu_logprob, b.pi_logprob).item() == pytest.approx(0.181, abs=5e-4)


def test_dppo_blocks_only_the_harmful_direction():
    # Same large TV, but pi moved against the advantage's push: the update heals the move, DPPO keeps it.
    assert get_loss("dppo_binary_tv")(batch_of([0.80], [0.99], [1.0])).keep.item()
    assert get_loss("dppo_binary_tv")(batch_of([0.99], [0.80], [-1.0])).keep.item()
    assert not get_loss("dppo_binary_tv")(batch_of([0.99], [0.80], [1.0])).keep.item()


def test_zero_advantage_takes_negative_branch():
    assert not get_loss("dppo_binary_tv")(batch_of([0.5], [0.9], [0.0])).keep.item()
    assert get_loss("dppo_binary_tv")(batch_of([0.9], [0.5], [0.0])).keep.item()
    out = get_loss("pg_is")(batch_of([0.5], [0.9], [0.0], grad=True))
    assert out.loss.item() == 0.0
    # The same convention for the ratio rules: A = 0 with r = 0.5 / 0.9 < 0.8 falls in the negative branch.
    b = batch_of([0.5, 0.5], [0.9, 0.9], [0.0, -1.0])
    for name in ("ppo_clip", "grpo", "ppo_lowprob_relax"):
        assert get_loss(name)(b).keep.tolist() == [[False, False]], name
    assert get_loss("minimal_negative_mask")(batch_of([0.1], [0.9], [0.0])).keep.tolist() == [[False]]
    assert get_loss("ppo_clip")(batch_of([0.5], [0.1], [0.0]), dual_clip=3.0).keep.tolist() == [[False]]
    # ... and such a token is never counted as blocked: it carries no gradient.
    m = get_loss("ppo_clip")(b).metrics
    assert m["policy/n_blocked"].item() == 1 and m["policy/blocked_frac"].item() == 1.0


def test_thresholds_are_strict():
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    up = torch.tensor([0.0, -1.0, 0.0, -1.0], dtype=torch.float64)
    down = torch.tensor([-1.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    div = torch.tensor([0.15, 0.15, 0.150001, 0.150001], dtype=torch.float64)
    assert family.dppo_keep(div, up, down, adv, 0.15).tolist() == [True, True, False, False]
    r = torch.tensor([1.28, 0.8, 1.2800001, 0.7999999], dtype=torch.float64)
    assert family.ppo_keep(r, adv, 0.2, 0.28).tolist() == [True, True, False, False]
    # Mask-delta is inclusive: mu - pi >= delta (PAPER.md).
    assert not get_loss("minimal_negative_mask")(batch_of([0.25], [0.75], [-1.0])).keep.item()
    assert get_loss("minimal_negative_mask")(batch_of([0.25], [0.75], [1.0])).keep.item()


def test_dual_clip_blocks_large_ratio_negative_tokens():
    b = batch_of([0.5, 0.5, 0.5], [0.1, 0.1, 0.4], [-1.0, 1.0, -1.0])  # r = 5, 5, 1.25
    rule = get_loss("ppo_clip")
    assert rule(b).keep.tolist() == [[True, False, True]]
    assert rule(b, dual_clip=3.0).keep.tolist() == [[False, False, True]]


def test_decoupled_rules_anchor_on_old_logprob():
    # mu = pi (no mismatch) but pi_old far: only the pi_old-anchored masks react.
    b = batch_of([0.5], [0.5], [1.0], old=[0.05])
    assert get_loss("dppo_binary_kl")(b).keep.item()
    assert not get_loss("dppo_decoupled")(b).keep.item()
    assert get_loss("ppo_clip")(b).keep.item()
    assert not get_loss("minirl")(b).keep.item()


def test_dppo_with_ratio_distance_is_ppo():
    """DPPO's mask with D = |r - 1| and delta = eps is PPO's mask (where A != 0)."""
    name = "test_dppo_ratio_distance"

    @register_loss(name, delta=0.2)
    def dppo_ratio(batch: PolicyBatch, delta: float) -> LossOutput:
        """DPPO gated on |r - 1|."""
        r = D.ratio(batch.pi_logprob.detach(), batch.mu_logprob)
        keep = family.dppo_keep((r - 1).abs(), batch.pi_logprob.detach(), batch.mu_logprob, batch.advantages, delta)
        return L.policy_loss(batch, keep, L.is_weight(batch.pi_logprob, batch.mu_logprob))

    try:
        assert name in list_losses()
        assert get_loss(name).doc == "DPPO gated on |r - 1|."
        g = torch.Generator().manual_seed(3)
        b = random_batch(g, 2000)
        ours = get_loss(name)(b)
        ppo = get_loss("grpo")(b)
        nz = b.advantages != 0
        assert torch.equal(ours.keep[nz], ppo.keep[nz])
        assert (~ppo.keep).sum() > 50 and ppo.keep.sum() > 50
        torch.testing.assert_close(ours.loss, ppo.loss)
        with pytest.raises(ValueError, match="already registered"):
            register_loss(name, delta=0.1)(dppo_ratio)
    finally:
        L._REGISTRY.pop(name, None)


# --- gradients -----------------------------------------------------------------------------------------------------


def random_batch(g: torch.Generator, n: int, *, v: int = 8, k: int = 3, dtype: torch.dtype = torch.float64,
                 scale: float = 1.5, pad: bool = False) -> PolicyBatch:
    """``n`` tokens from random mu / pi / pi_old over a ``v``-token vocabulary; top-K over mu with a forced in."""
    mu_logits = 2 * torch.randn(n, v, generator=g, dtype=torch.float64)
    spread = scale * torch.rand(n, 1, generator=g, dtype=torch.float64)
    pi_logits = mu_logits + spread * torch.randn(n, v, generator=g, dtype=torch.float64)
    old_logits = mu_logits + 0.5 * spread * torch.randn(n, v, generator=g, dtype=torch.float64)
    mu_all, pi_all, old_all = (torch.log_softmax(x, -1) for x in (mu_logits, pi_logits, old_logits))
    a = torch.multinomial(mu_all.exp(), 1, generator=g).squeeze(-1)  # (n,)
    ids = torch.argsort(mu_all, -1, descending=True)[:, :k]  # (n, K)
    ids, _ = D.force_sampled_into_topk(ids, mu_all.gather(-1, ids), a, mu_all.gather(-1, a[:, None])[:, 0])
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[torch.rand(n, generator=g) < 0.1] = 0.0
    mask = torch.ones(n, dtype=torch.bool)
    if pad:
        mask[torch.rand(n, generator=g) < 0.2] = False

    def shape(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n // 100 if n % 100 == 0 else 1, -1, *x.shape[1:]).to(dtype)

    return PolicyBatch(
        pi_logprob=shape(pi_all.gather(-1, a[:, None])[:, 0]),
        mu_logprob=shape(mu_all.gather(-1, a[:, None])[:, 0]),
        advantages=shape(adv), mask=shape(mask).bool(),
        old_logprob=shape(old_all.gather(-1, a[:, None])[:, 0]),
        mu_topk_logprobs=shape(mu_all.gather(-1, ids)), pi_topk_logprobs=shape(pi_all.gather(-1, ids)),
    )


@pytest.mark.parametrize("name", RULES)
def test_gradient_is_closed_form_and_zero_when_blocked(name):
    g = torch.Generator().manual_seed(11)
    b = random_batch(g, 600, pad=True)
    pi_lp = b.pi_logprob.clone().requires_grad_(True)
    b = PolicyBatch(**{**b.__dict__, "pi_logprob": pi_lp})
    rule = get_loss(name)
    out = rule(b)
    out.loss.sum().backward()
    grad = pi_lp.grad
    blocked = ~out.keep
    assert blocked.any() or name in NEVER_BLOCK
    assert (grad[blocked] == 0).all()
    assert (out.loss[blocked] == 0).all()
    cap = rule.defaults.get("is_cap", math.inf)
    w = torch.exp((b.pi_logprob.detach() - b.mu_logprob).clamp(max=20)).clamp(max=cap)
    expected = torch.where(out.keep, -b.advantages * w, torch.zeros_like(w))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    for key in ("policy/blocked_frac", "policy/blocked_frac_pos", "policy/blocked_frac_neg",
                "policy/mismatch_abs_mean", "policy/k3_kl"):
        assert torch.isfinite(out.metrics[key]), key
        assert not out.metrics[key].requires_grad


def test_gradient_through_logits():
    """pi_logprob gathered from logits: d loss / d logits = -A w M (onehot(a) - softmax)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)  # (B, T, V)
    a = torch.randint(0, 7, (2, 5), generator=g)  # (B, T)
    pi_lp = torch.log_softmax(logits, -1).gather(-1, a[..., None])[..., 0]  # (B, T)
    mu_lp = pi_lp.detach() + 0.8 * torch.randn(2, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(2, 5, generator=g, dtype=torch.float64)
    b = PolicyBatch(pi_logprob=pi_lp, mu_logprob=mu_lp, advantages=adv, mask=torch.ones(2, 5, dtype=torch.bool))
    out = get_loss("dppo_binary_tv")(b, delta=0.05)
    out.loss.sum().backward()
    w = torch.exp((pi_lp.detach() - mu_lp).clamp(max=20))
    coef = (-adv * w * out.keep)[..., None]
    onehot = torch.nn.functional.one_hot(a, 7).double()
    expected = coef * (onehot - torch.softmax(logits.detach(), -1))
    torch.testing.assert_close(logits.grad, expected)
    assert (~out.keep).any() and out.keep.any()


def test_padding_with_garbage_is_ignored():
    g = torch.Generator().manual_seed(2)
    b = random_batch(g, 400, pad=True, dtype=torch.float32)
    pad = ~b.mask
    garbage = PolicyBatch(**{
        **b.__dict__,
        "pi_logprob": torch.where(pad, torch.tensor(-math.inf), b.pi_logprob).requires_grad_(True),
        "mu_logprob": torch.where(pad, torch.tensor(math.nan), b.mu_logprob),
        "advantages": torch.where(pad, torch.tensor(math.inf), b.advantages),
    })
    for name in [*RULES, *SEQUENCE_RULES, "drpo"]:
        clean, dirty = get_loss(name)(b), get_loss(name)(garbage)
        assert torch.equal(clean.keep, dirty.keep), name
        torch.testing.assert_close(clean.loss, dirty.loss)
        for key, value in clean.metrics.items():
            torch.testing.assert_close(value, dirty.metrics[key], msg=f"{name} {key}")
    get_loss("dppo_binary_kl")(garbage).loss.sum().backward()
    assert torch.isfinite(garbage.pi_logprob.grad).all()
    assert (garbage.pi_logprob.grad[pad] == 0).all()


def test_metrics_values():
    """Blocked fractions count only the tokens that carry gradient (A != 0), with the counts beside them."""
    b = batch_of([1e-2, 0.80, 0.5, 0.5], [1e-4, 0.99, 0.5, 0.5], [1.0, -1.0, 1.0, 0.0])
    m = get_loss("ppo_clip")(b).metrics
    assert m["policy/blocked_frac"].item() == pytest.approx(1 / 3)
    assert m["policy/n_blocked"].item() == 1 and m["policy/n_grad_tokens"].item() == 3
    assert m["policy/blocked_frac_pos"].item() == pytest.approx(0.5)
    assert m["policy/blocked_frac_neg"].item() == pytest.approx(0.0)
    assert m["policy/mismatch_abs_mean"].item() == pytest.approx((0.0099 + 0.19) / 4)
    k3 = [(r - 1) - math.log(r) for r in (100.0, 0.8 / 0.99, 1.0, 1.0)]
    assert m["policy/k3_kl"].item() == pytest.approx(sum(k3) / 4)
    m = get_loss("dppo_binary_tv")(b).metrics
    assert m["policy/blocked_frac_neg"].item() == pytest.approx(1.0)  # the one A < 0 token; A = 0 is not counted


# --- bf16 ------------------------------------------------------------------------------------------------------------


def _margins(name: str, x: dict[str, torch.Tensor], adv: torch.Tensor) -> list[torch.Tensor]:
    """Signed decision quantities of a rule's mask; the mask is a function of their signs."""
    pi, mu = x["pi_logprob"], x["mu_logprob"]
    if name == "ppo_clip":
        r = torch.exp(pi - mu)
        return [torch.where(adv > 0, r - 1.28, r - 0.8)]
    div = {
        "dppo_binary_tv": lambda: D.binary_tv(mu, pi) - 0.15,
        "dppo_binary_kl": lambda: D.binary_kl(mu, pi) - 0.05,
        "dppo_topk_tv": lambda: D.topk_tv(x["mu_topk_logprobs"], x["pi_topk_logprobs"]) - 0.15,
        "dppo_topk_kl": lambda: D.topk_kl(x["mu_topk_logprobs"], x["pi_topk_logprobs"]) - 0.05,
    }[name]()
    return [div, pi - mu]


@pytest.mark.parametrize("name", ["ppo_clip", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl"])
def test_bf16_masks_match_fp32_outside_the_band(name):
    g = torch.Generator().manual_seed(7)
    b32 = random_batch(g, 20000, dtype=torch.float32, scale=1.0)
    fields = ("pi_logprob", "mu_logprob", "mu_topk_logprobs", "pi_topk_logprobs")
    b16 = PolicyBatch(**{**b32.__dict__, **{f: getattr(b32, f).bfloat16() for f in fields}})
    keep32, keep16 = get_loss(name)(b32).keep, get_loss(name)(b16).keep
    # The band: a first-order worst case of every input logprob moving by BF16_BAND_RTOL * |x|.
    x = {f: getattr(b32, f).clone().requires_grad_(True) for f in fields}
    bands, margins = [], _margins(name, x, b32.advantages)
    for margin in margins:
        grads = torch.autograd.grad(margin.sum(), list(x.values()), allow_unused=True, retain_graph=True)
        reach = torch.zeros_like(margin)
        for f, gr in zip(fields, grads, strict=True):
            if gr is not None:
                term = (gr * x[f].detach()).abs() * D.BF16_BAND_RTOL
                reach = reach + (term.sum(-1) if term.ndim == 3 else term)
        bands.append(margin.detach().abs() <= reach)
    in_band = bands[0]
    if len(bands) == 2:  # DPPO: the direction pi vs mu only matters where D may exceed delta
        in_band = in_band | (bands[1] & (margins[0].detach() > 0))
    differ = keep32 != keep16
    assert not (differ & ~in_band).any(), f"{int((differ & ~in_band).sum())} bf16 mask flips outside the band"
    assert in_band.float().mean() < 0.08  # the band is narrow (1-6% of tokens here): the check has teeth
    assert (~keep32).sum() > 100


# --- the slow reference --------------------------------------------------------------------------------------------


def _ref_binary_kl(mu: float, pi: float) -> float:
    rest_mu, rest_pi = max(1 - mu, 1e-12), max(1 - pi, 1e-12)
    return mu * math.log(mu / pi) + rest_mu * math.log(rest_mu / rest_pi)


def _ref_topk(mu_k: list[float], pi_k: list[float]) -> tuple[float, float]:
    p = [math.exp(v) for v in mu_k]
    q = [math.exp(v) for v in pi_k]
    p_rest, q_rest = max(1 - sum(p), 1e-12), max(1 - sum(q), 1e-12)
    tv = 0.5 * (sum(abs(a - b) for a, b in zip(p, q, strict=True)) + abs(p_rest - q_rest))
    kl = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)) + p_rest * math.log(p_rest / q_rest)
    return tv, kl


def _ppo_ref(r: float, adv: float, eps_low: float, eps_high: float, margins: list[float], alpha: float = 0.0,
             mu: float = 1.0) -> bool:
    margins.extend([r - (1 + eps_high), r - (1 - eps_low), mu - alpha])
    if adv > 0 and r > 1 + eps_high and mu >= alpha:
        return False
    return not (adv <= 0 and r < 1 - eps_low and mu >= alpha)


def _dppo_ref(div: float, delta: float, pi_lp: float, anchor_lp: float, adv: float, margins: list[float]) -> bool:
    margins.extend([div - delta, pi_lp - anchor_lp])
    if div <= delta:
        return True
    return not pi_lp > anchor_lp if adv > 0 else not pi_lp < anchor_lp


def _is_w(tok: dict, cap: float = math.inf) -> float:
    return min(math.exp(min(tok["pi_lp"] - tok["mu_lp"], 20.0)), cap)


def token_reference(keep_of: Callable[[dict, list[float]], bool], cap: float = math.inf) -> Callable:
    """A token-level rule's reference over one response: each token's keep from ``keep_of(token, margins)``,
    its loss -A w log pi with w = min(pi/mu, cap) where kept."""

    def ref(tokens: list[dict]) -> list[tuple[bool, float, list[float]]]:
        out = []
        for tok in tokens:
            margins: list[float] = []
            keep = keep_of(tok, margins)
            out.append((keep, -tok["adv"] * _is_w(tok, cap) * tok["pi_lp"] if keep else 0.0, margins))
        return out

    return ref


def _seq_ratio_reference(keep_of: Callable[[float, dict, list[float]], bool],
                         weight_of: Callable[[float, dict], float]) -> Callable:
    """A rule on the response's mean log-ratio m: keep_of(m, token, margins), weight_of(m, token)."""

    def ref(tokens: list[dict]) -> list[tuple[bool, float, list[float]]]:
        m = sum(t["pi_lp"] - t["mu_lp"] for t in tokens) / len(tokens)
        out = []
        for tok in tokens:
            margins: list[float] = []
            keep = keep_of(m, tok, margins)
            out.append((keep, -tok["adv"] * weight_of(m, tok) * tok["pi_lp"] if keep else 0.0, margins))
        return out

    return ref


def _p90(values: list[float]) -> float:
    """torch.quantile's linear interpolation at 0.9."""
    v = sorted(values)
    pos = 0.9 * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def _cppo_reference(tokens: list[dict], delta: float = 0.15, w_min: float = 0.8,
                    delta_b: float = 0.02) -> list[tuple[bool, float, list[float]]]:
    n = len(tokens)
    div = [abs(math.exp(t["pi_lp"]) - math.exp(t["mu_lp"])) for t in tokens]
    budget = min(max(_p90(div), delta_b), 2 * delta_b)
    spent = weight = 0.0
    out = []
    for s, tok in enumerate(tokens):
        w = w_min + (1 - w_min) * (n - 1 - s) / max(n - 1, 1)
        z = w * div[s]
        threshold = min(delta, delta + budget * weight - spent)
        harmful = tok["pi_lp"] > tok["mu_lp"] if tok["adv"] > 0 else tok["pi_lp"] < tok["mu_lp"]
        keep = not (harmful and z > threshold)
        out.append((keep, -tok["adv"] * _is_w(tok) * tok["pi_lp"] if keep else 0.0,
                    [z - threshold, tok["pi_lp"] - tok["mu_lp"]]))
        spent, weight = spent + z, weight + w
    return out


def _drpo_reference(tokens: list[dict], delta: float = 0.15) -> list[tuple[bool, float, list[float]]]:
    out = []
    for tok in tokens:
        shift = math.exp(tok["pi_lp"]) - math.exp(tok["mu_lp"])
        g = 1 - (1.0 if tok["adv"] > 0 else -1.0) * shift / delta
        out.append((g > 0, -tok["adv"] * _is_w(tok) * g * tok["pi_lp"], [g]))  # applied everywhere: no hard gate
    return out


def _mu(t: dict) -> float:
    return math.exp(t["mu_lp"])


def _pi(t: dict) -> float:
    return math.exp(t["pi_lp"])


def _r(t: dict, anchor: str = "mu_lp") -> float:
    return math.exp(min(t["pi_lp"] - t[anchor], 20.0))


REFERENCE: dict[str, Callable[[list[dict]], list[tuple[bool, float, list[float]]]]] = {
    "pg_is": token_reference(lambda t, m: True),
    "cispo": token_reference(lambda t, m: True, cap=2.0),
    "token_tis": token_reference(lambda t, m: True, cap=2.0),
    "ppo_clip": token_reference(lambda t, m: _ppo_ref(_r(t), t["adv"], 0.2, 0.28, m)),
    "grpo": token_reference(lambda t, m: _ppo_ref(_r(t), t["adv"], 0.2, 0.2, m)),
    "minirl": token_reference(lambda t, m: _ppo_ref(_r(t, "old_lp"), t["adv"], 0.2, 0.28, m)),
    "minirl_tis": token_reference(lambda t, m: _ppo_ref(_r(t, "old_lp"), t["adv"], 0.2, 0.28, m), cap=2.0),
    "ppo_lowprob_relax": token_reference(lambda t, m: _ppo_ref(_r(t), t["adv"], 0.2, 0.28, m, 0.1, _mu(t))),
    "dppo_binary_tv": token_reference(
        lambda t, m: _dppo_ref(abs(_pi(t) - _mu(t)), 0.15, t["pi_lp"], t["mu_lp"], t["adv"], m)),
    "dppo_binary_kl": token_reference(
        lambda t, m: _dppo_ref(_ref_binary_kl(_mu(t), _pi(t)), 0.05, t["pi_lp"], t["mu_lp"], t["adv"], m)),
    "dppo_topk_tv": token_reference(
        lambda t, m: _dppo_ref(_ref_topk(t["mu_k"], t["pi_k"])[0], 0.15, t["pi_lp"], t["mu_lp"], t["adv"], m)),
    "dppo_topk_kl": token_reference(
        lambda t, m: _dppo_ref(_ref_topk(t["mu_k"], t["pi_k"])[1], 0.05, t["pi_lp"], t["mu_lp"], t["adv"], m)),
    "dppo_decoupled": token_reference(lambda t, m: _dppo_ref(
        _ref_binary_kl(math.exp(t["old_lp"]), _pi(t)), 0.05, t["pi_lp"], t["old_lp"], t["adv"], m)),
    "minimal_negative_mask": token_reference(
        lambda t, m: m.append(_mu(t) - _pi(t) - 0.5) or not (t["adv"] <= 0 and _mu(t) - _pi(t) >= 0.5)),
    "token_mis": token_reference(lambda t, m: m.extend([_r(t) - 0.5, _r(t) - 2.0]) or 0.5 <= _r(t) <= 2.0),
    "icepop": token_reference(lambda t, m: m.extend([_r(t) - 0.5, _r(t) - 5.0]) or 0.5 <= _r(t) <= 5.0),
    "gspo": _seq_ratio_reference(
        lambda mean, t, m: _ppo_ref(math.exp(min(mean, 10.0)), t["adv"], 3e-4, 4e-4, m),
        lambda mean, t: math.exp(min(mean, 10.0))),
    "geo_mask": _seq_ratio_reference(
        lambda mean, t, m: m.extend([math.exp(mean) - 0.999, math.exp(mean) - 1.001])
        or 0.999 <= math.exp(mean) <= 1.001,
        lambda mean, t: _is_w(t)),
    "cppo": _cppo_reference,
    "drpo": _drpo_reference,
}
"""PAPER.md (and each rule's source) in plain float64 Python, one response at a time: per token (keep, loss,
decision margins). Every built-in rule has one (``test_every_rule_has_a_reference``)."""
def test_every_rule_has_a_reference():
    assert set(REFERENCE) == set(L.BUILTIN_RULES)


FP32_BAND = 1e-4
"""fp32 masks are held to the reference except on tokens with a decision margin within this of zero."""


def _rows(b: PolicyBatch, t: int) -> PolicyBatch:
    """``b``'s tokens as responses of ``t`` tokens."""
    return PolicyBatch(**{f: None if v is None else v.reshape(-1, t, *v.shape[2:]) for f, v in b.__dict__.items()})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rules_match_slow_reference(dtype):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    b = _rows(random_batch(g, 3000, dtype=dtype, scale=2.0, pad=True), 6)  # 500 responses of up to 6 tokens
    rows = []
    for i in range(b.mask.shape[0]):
        valid = b.mask[i].tolist()
        rows.append([j for j in range(len(valid)) if valid[j]])
    flat = {f: getattr(b, f).double().tolist() for f in ("pi_logprob", "mu_logprob", "old_logprob", "advantages",
                                                          "mu_topk_logprobs", "pi_topk_logprobs")}
    excluded = checked = 0
    for name in sorted(REFERENCE):
        out = get_loss(name)(b)
        keep, loss = out.keep.tolist(), out.loss.detach().double().tolist()
        n_blocked = 0
        for i, positions in enumerate(rows):
            if not positions:
                continue
            tokens = [{"pi_lp": flat["pi_logprob"][i][j], "mu_lp": flat["mu_logprob"][i][j],
                       "old_lp": flat["old_logprob"][i][j], "adv": flat["advantages"][i][j],
                       "mu_k": flat["mu_topk_logprobs"][i][j], "pi_k": flat["pi_topk_logprobs"][i][j]}
                      for j in positions]
            for j, (ref_keep, ref_loss, margins) in zip(positions, REFERENCE[name](tokens), strict=True):
                checked += 1
                n_blocked += not ref_keep
                if dtype == torch.float32 and any(abs(m) <= FP32_BAND for m in margins):
                    excluded += 1
                    continue
                assert keep[i][j] == ref_keep, (name, i, j, margins)
                rel = 1e-9 if dtype == torch.float64 else 1e-4
                assert loss[i][j] == pytest.approx(ref_loss, rel=rel, abs=1e-12), (name, i, j)
        if name not in NEVER_BLOCK:
            assert n_blocked > 10, (name, n_blocked)  # the blocking branch is exercised
    assert excluded < 0.01 * checked


# --- errors --------------------------------------------------------------------------------------------------------


def test_unknown_rule_lists_valid_names():
    with pytest.raises(KeyError, match=r"unknown loss rule 'dppo'.*dppo_binary_tv.*ppo_clip"):
        get_loss("dppo")


@pytest.mark.parametrize(("name", "params", "pattern"), [
    ("dppo_binary_tv", {"delta": -0.1}, r"delta=-0.1 must be >= 0"),
    ("dppo_binary_kl", {"delta": math.nan}, r"delta=nan must be a number"),
    ("ppo_clip", {"eps_low": 1.0}, r"eps_low=1.0 must be in \[0, 1\)"),
    ("ppo_clip", {"eps_high": -0.5}, r"eps_high=-0.5 must be >= 0"),
    ("ppo_clip", {"dual_clip": 0.5}, r"dual_clip=0.5 must be > 1"),
    ("cispo", {"is_cap": 0}, r"is_cap=0 must be > 0"),
    ("ppo_lowprob_relax", {"alpha_low": 1.5}, r"alpha_low=1.5 must be a probability"),
    ("dppo_binary_tv", {"divergence": "full_tv"}, r"divergence='full_tv' is not one of"),
    ("dppo_binary_tv", {"eps": 0.2}, r"unknown parameter\(s\) \['eps'\]"),
])
def test_bad_parameters_name_argument_and_value(name, params, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        get_loss(name)(batch_of([0.5], [0.5], [1.0]), **params)


def test_bad_batches_name_field():
    b = batch_of([0.5, 0.4], [0.5, 0.4], [1.0, -1.0])
    rule = get_loss("dppo_topk_tv")
    with pytest.raises(ValueError, match=r"PolicyBatch.mu_logprob has shape \(1, 3\)"):
        rule(PolicyBatch(**{**b.__dict__, "mu_logprob": torch.zeros(1, 3)}))
    with pytest.raises(ValueError, match=r"PolicyBatch\.advantages holds NaN on 1 unmasked token"):
        rule(PolicyBatch(**{**b.__dict__, "advantages": torch.tensor([[1.0, math.nan]])}))
    with pytest.raises(ValueError, match=r"PolicyBatch\.pi_topk_logprobs holds NaN on 1 unmasked token"):
        rule(PolicyBatch(**{**b.__dict__, "pi_topk_logprobs": torch.tensor([[[math.nan], [-1.0]]])}))
    with pytest.raises(ValueError, match="K=0"):
        rule(PolicyBatch(**{**b.__dict__, "mu_topk_logprobs": torch.zeros(1, 2, 0),
                            "pi_topk_logprobs": torch.zeros(1, 2, 0)}))
    with pytest.raises(ValueError, match="must have the same K"):
        rule(PolicyBatch(**{**b.__dict__, "mu_topk_logprobs": torch.zeros(1, 2, 3)}))
    with pytest.raises(ValueError, match=r"needs PolicyBatch\.mu_topk_logprobs"):
        rule(PolicyBatch(**{**b.__dict__, "mu_topk_logprobs": None}))
    with pytest.raises(ValueError, match=r"needs PolicyBatch\.old_logprob"):
        get_loss("minirl")(PolicyBatch(**{**b.__dict__, "old_logprob": None}))


def test_register_rejects_incomplete_rules():
    def rule(batch: PolicyBatch, delta: float, beta: float) -> LossOutput:
        raise AssertionError

    with pytest.raises(ValueError, match=r"no default for parameter\(s\) \['beta'\]"):
        register_loss("test_incomplete", delta=0.1)(rule)
    with pytest.raises(ValueError, match=r"needs=.*'topk'"):
        register_loss("test_bad_needs", needs=("topk",), delta=0.1, beta=1.0)(rule)
    with pytest.raises(ValueError, match="delta=-1 must be >= 0"):
        register_loss("test_bad_default", delta=L.Param(-1, low=0), beta=1.0)(rule)
    # a parameter's bounds are the rule's own: a plain delta of a user's rule inherits no other rule's bounds
    register_loss("test_own_bounds", delta=-1.0, beta=1.0)(rule)
    assert get_loss("test_own_bounds").resolve(delta=-2.0)["delta"] == -2.0
    del L._REGISTRY["test_own_bounds"]
    assert not {"test_incomplete", "test_bad_needs", "test_bad_default"} & set(list_losses())


# --- the rules people run today (hand-computed cases) ------------------------------------------------------------


def seq_batch(pi: list[list[float]], mu: list[list[float]], adv: list[float], *, grad: bool = False) -> PolicyBatch:
    """Right-padded sequences given by probabilities (padding: shorter rows), one advantage per sequence."""
    t = max(map(len, pi))

    def pad(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([[math.log(x) for x in r] + [0.0] * (t - len(r)) for r in rows], dtype=torch.float64)

    mask = torch.tensor([[True] * len(r) + [False] * (t - len(r)) for r in pi])
    return PolicyBatch(pi_logprob=pad(pi).requires_grad_(grad), mu_logprob=pad(mu),
                       advantages=torch.tensor(adv, dtype=torch.float64)[:, None].expand(-1, t).clone(), mask=mask)


def test_token_mis_and_icepop_drop_the_ratio_band_on_both_sides():
    mu = [0.5] * 6
    pi = [0.19, 0.25, 0.5, 1.0, 0.999, 0.5]  # r = 0.38, 0.5, 1, 2, 1.998, 1
    b = batch_of(pi, mu, [1.0, -1.0, 1.0, -1.0, 1.0, 0.0])
    assert get_loss("token_mis")(b).keep.tolist() == [[False, True, True, True, True, True]]
    b = batch_of([0.002, 0.6], [0.01, 0.1], [1.0, -1.0])  # r = 0.2, 6
    assert get_loss("icepop")(b).keep.tolist() == [[False, False]]
    b = batch_of([0.0051, 0.49], [0.01, 0.1], [1.0, -1.0])  # r = 0.51, 4.9
    assert get_loss("icepop")(b).keep.tolist() == [[True, True]]
    assert get_loss("token_mis")(b).keep.tolist() == [[True, False]]


def test_token_tis_truncates_the_weight_and_never_masks():
    b = batch_of([0.9, 0.3], [0.3, 0.3], [1.0, -2.0], grad=True)  # r = 3, 1
    out = get_loss("token_tis")(b)
    assert out.keep.all()
    torch.testing.assert_close(out.loss, torch.tensor([[-2.0 * math.log(0.9), 2.0 * math.log(0.3)]],
                                                      dtype=torch.float64))


def test_gspo_clips_the_geometric_mean_ratio_per_response():
    # r per token: [1.001, 1.0] -> s = sqrt(1.001) = 1.0004999 > 1 + 4e-4: A > 0 response blocked as a whole.
    # [1.0008, 1.0] -> s = 1.00039992 < 1.0004: kept. [0.9990, 1.0] with A < 0: s = 0.99949987 < 1 - 3e-4: blocked.
    b = seq_batch([[0.5005, 0.5], [0.5004, 0.5], [0.4995, 0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5, 0.5]],
                  [1.0, 1.0, -1.0], grad=True)
    out = get_loss("gspo")(b)
    assert out.keep.tolist() == [[False, False, False], [True, True, False], [False, False, False]]
    out.loss.sum().backward()
    s = math.sqrt(1.0008)
    torch.testing.assert_close(b.pi_logprob.grad[1, :2], torch.tensor([-s, -s], dtype=torch.float64))
    assert (b.pi_logprob.grad[0] == 0).all() and (b.pi_logprob.grad[2] == 0).all()


def test_geo_mask_drops_whole_responses_outside_the_band():
    # geometric means: sqrt(1.002) = 1.0009995 (kept), sqrt(1.003) = 1.0014989 (dropped), sqrt(0.997) (dropped).
    b = seq_batch([[0.501, 0.5], [0.5015, 0.5], [0.4985, 0.5]], [[0.5, 0.5]] * 3, [1.0, -1.0, 1.0])
    assert get_loss("geo_mask")(b).keep.tolist() == [[True, True], [False, False], [False, False]]


def test_cppo_position_weights_and_prefix_budget():
    # binary TV D = 0.14, 0.16, 0.18 over L = 3 positions; w_min = 0.8: w = 1, 0.9, 0.8 and Z = w D = 0.14, 0.144,
    # 0.144, all within delta = 0.15 (DPPO blocks the last two). Prefix sums: W = 0, 1, 1.9; S = 0, 0.14, 0.284.
    # P90(D) = 0.176, so the budget b = clamp(0.176, delta_b, 2 delta_b) and c = min(0.15, 0.15 + b W - S).
    pi, mu = [[0.64, 0.66, 0.68]], [[0.5, 0.5, 0.5]]
    rule = get_loss("cppo")
    assert get_loss("dppo_binary_tv")(seq_batch(pi, mu, [1.0])).keep.tolist() == [[True, False, False]]
    # delta_b = 0.02 (the default): b = 0.04, c = 0.15, 0.05, -0.058
    assert rule(seq_batch(pi, mu, [1.0])).keep.tolist() == [[True, False, False]]
    # delta_b = 0.1: b = 0.176, c = 0.15, 0.15, 0.15: the position weights keep all three
    assert rule(seq_batch(pi, mu, [1.0]), delta_b=0.1).keep.tolist() == [[True, True, True]]
    # delta_b = 0.07: b = 0.14, c = 0.15, 0.15, 0.132: the prefix has spent its budget by the last token
    assert rule(seq_batch(pi, mu, [1.0]), delta_b=0.07).keep.tolist() == [[True, True, False]]
    # no position weighting: DPPO's token threshold again
    assert rule(seq_batch(pi, mu, [1.0]), delta_b=0.1, w_min=1.0).keep.tolist() == [[True, False, False]]
    # a one-token response has weight w_min: Z = 0.8 * 0.18 = 0.144 <= 0.15
    assert rule(seq_batch([[0.68]], [[0.5]], [1.0]), delta_b=0.1).keep.tolist() == [[True]]
    # pi moved against the push (A < 0, pi > mu): never blocked, whatever the budget.
    assert rule(seq_batch(pi, mu, [-1.0]), delta_b=0.0).keep.all()
    # Padding does not count as a position: the same tokens in a longer padded batch give the same mask.
    padded = seq_batch([[0.64, 0.66, 0.68], [0.5] * 5], [[0.5, 0.5, 0.5], [0.5] * 5], [1.0, 1.0])
    assert rule(padded, delta_b=0.07).keep[0, :3].tolist() == [True, True, False]


def test_drpo_weight_is_smooth_and_blocked_means_a_cancelled_push():
    # g = 1 - sign(A) (pi - mu) / delta, delta = 0.15; w = (pi / mu) g.
    pi, mu, adv = [0.6, 0.8, 0.4, 0.4, 0.3], [0.5] * 5, [1.0, 1.0, 1.0, -1.0, -1.0]
    g = [1 - 0.1 / 0.15, 1 - 0.3 / 0.15, 1 + 0.1 / 0.15, 1 - 0.1 / 0.15, 1 - 0.2 / 0.15]
    b = batch_of(pi, mu, adv, grad=True)
    out = get_loss("drpo")(b)
    assert out.keep.tolist() == [[True, False, True, True, False]]
    out.loss.sum().backward()
    expected = torch.tensor([[-a * (p / m) * gi for p, m, a, gi in zip(pi, mu, adv, g, strict=True)]],
                            dtype=torch.float64)
    torch.testing.assert_close(b.pi_logprob.grad, expected)
    assert b.pi_logprob.grad[0, 1] > 0  # beyond the boundary the gradient corrects: it pushes pi back down
    assert out.metrics["policy/n_blocked"].item() == 2
    with pytest.raises(ValueError, match=r"delta=0\.0 must be > 0"):
        get_loss("drpo")(b, delta=0.0)


@pytest.mark.parametrize("name", SEQUENCE_RULES)
def test_sequence_rules_gradient_and_padding(name):
    g = torch.Generator().manual_seed(11)
    b = random_batch(g, 600, pad=True, scale=0.3)
    pi_lp = b.pi_logprob.clone().requires_grad_(True)
    b = PolicyBatch(**{**b.__dict__, "pi_logprob": pi_lp})
    out = get_loss(name)(b)
    out.loss.sum().backward()
    assert (~out.keep & b.mask).any() and (out.keep & b.mask).any()
    assert (pi_lp.grad[~out.keep] == 0).all()
    lr = b.pi_logprob.detach() - b.mu_logprob
    if name == "gspo":
        n = b.mask.sum(-1, keepdim=True)
        w = torch.exp((torch.where(b.mask, lr, 0).sum(-1, keepdim=True) / n).clamp(max=10)).expand_as(lr)
    else:
        w = torch.exp(lr.clamp(max=20))
    torch.testing.assert_close(pi_lp.grad, torch.where(out.keep, -b.advantages * w, 0.0), rtol=1e-12, atol=0)


def test_rules_load_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "ts_user_rules.py").write_text(
        "from trustscope.losses import DPPO_MU, register_loss, dppo\n"
        "register_loss('user_tight_tv', sql=DPPO_MU, divergence='binary_tv', delta=0.05)(dppo)\n"
        "@register_loss('user_plain', sql=DPPO_MU, divergence='binary_tv', delta=0.2)\n"
        "def plain(batch, divergence, delta):\n"
        "    return dppo(batch, divergence=divergence, delta=delta)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert get_loss("ts_user_rules:user_tight_tv").name == "user_tight_tv"
        assert get_loss("ts_user_rules:plain").name == "user_plain"  # by the function's attribute name
        assert get_loss("ts_user_rules.user_plain").name == "user_plain"
        assert {"user_tight_tv", "user_plain"} <= set(list_losses())
        from trustscope.train.config import TrainConfig

        cfg = TrainConfig(loss="ts_user_rules:user_plain", loss_params={"delta": 0.1})  # the trainer's --loss
        assert cfg.run_id.startswith("user_plain-s0-")
        with pytest.raises(KeyError, match="registers no rule named 'nope'"):
            get_loss("ts_user_rules:nope")
        with pytest.raises(KeyError, match="cannot import module 'ts_no_such_module'"):
            get_loss("ts_no_such_module:rule")
    finally:
        for name in ("user_tight_tv", "user_plain"):
            L._REGISTRY.pop(name, None)


def test_register_checks_the_sql_family():
    def rule(batch: PolicyBatch, delta: float) -> LossOutput:
        raise AssertionError

    with pytest.raises(ValueError, match=r"passes parameter\(s\) \['divergence'\]"):
        register_loss("test_bad_family", sql=L.DPPO_MU, delta=0.1)(rule)
    with pytest.raises(ValueError, match="must match"):
        register_loss("Bad-Name", delta=0.1)(rule)
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['pi'\]"):
        L.SqlMask("x", ("pi",))
    assert "test_bad_family" not in list_losses()


def test_catalogue_lists_every_rule_with_its_family():
    table = L.catalogue_markdown()
    for name in list_losses():
        rule = get_loss(name)
        assert f"| `{name}` | `{rule.sql.family}`" in table, name
    assert "(sequence)" in table.split("`gspo`")[1].split("\n")[0]


# --- the mask-only entry point -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_keep_masks_equal_every_rules_loss_path_mask(dtype):
    g = torch.Generator().manual_seed(5)
    b = random_batch(g, 1200, pad=True, scale=2.0, dtype=dtype)
    pi_lp = b.pi_logprob.clone().requires_grad_(True)
    b = PolicyBatch(**{**b.__dict__, "pi_logprob": pi_lp})
    masks = L.keep_masks(b)
    assert set(masks) == set(list_losses())
    for name in list_losses():
        want = get_loss(name)(b).keep
        assert masks[name].dtype == torch.bool and not masks[name].requires_grad
        assert torch.equal(masks[name], want), name
        if name not in NEVER_BLOCK:
            assert (~want & b.mask).any(), name  # the rule blocks something here
    assert not masks["dppo_binary_tv"][~b.mask].any()  # padding is never kept
    # at other parameters too, and with the top-K divergences given instead of the lists
    params = {"ppo_clip": {"dual_clip": 1.2, "eps_high": 0.1}, "dppo_binary_tv": {"divergence": "topk_kl"},
              "dppo_decoupled": {"divergence": "binary_tv"}, "cppo": {"w_min": 0.5, "delta": 0.05}}
    masks = L.keep_masks(b, params, params=params)
    for name, p in params.items():
        assert torch.equal(masks[name], get_loss(name)(b, **p).keep), name
    given = {"topk_tv": D.topk_tv(b.mu_topk_logprobs, b.pi_topk_logprobs),
             "topk_kl": D.topk_kl(b.mu_topk_logprobs, b.pi_topk_logprobs)}
    no_lists = PolicyBatch(**{**b.__dict__, "mu_topk_logprobs": None, "pi_topk_logprobs": None})
    for name, keep in L.keep_masks(no_lists, ["dppo_topk_tv", "dppo_topk_kl"], given=given).items():
        assert torch.equal(keep, get_loss(name)(b).keep), name


def test_keep_masks_errors_and_rules_without_a_mask_function(monkeypatch):
    monkeypatch.setattr(L, "_REGISTRY", dict(L._REGISTRY))
    g = torch.Generator().manual_seed(6)
    b = random_batch(g, 300)
    no_old = PolicyBatch(**{**b.__dict__, "old_logprob": None})
    with pytest.raises(ValueError, match=r"'minirl' needs PolicyBatch\.old_logprob"):
        L.keep_masks(no_old, ["minirl"])
    with pytest.raises(ValueError, match="given term 'ratio'"):
        L.keep_masks(b, ["ppo_clip"], given={"ratio": b.pi_logprob})
    with pytest.raises(KeyError, match="unknown loss rule"):
        L.keep_masks(b, ["no_such_rule"])

    def bad_mask(terms, nope):
        return terms.valid

    with pytest.raises(ValueError, match=r"mask function 'bad_mask' takes parameter\(s\) \['nope'\]"):
        register_loss("keep_masks_bad", mask=bad_mask, divergence="binary_tv", delta=0.1)

    def every_other(batch: PolicyBatch, delta: float) -> LossOutput:
        """A rule registered without a mask function: keep_masks runs it whole."""
        keep = torch.zeros_like(batch.mask)
        keep[..., ::2] = True
        return L.policy_loss(batch, keep, L.is_weight(batch.pi_logprob, batch.mu_logprob))

    register_loss("keep_masks_plain", delta=0.1)(every_other)
    assert torch.equal(L.keep_masks(b, ["keep_masks_plain"])["keep_masks_plain"], get_loss("keep_masks_plain")(b).keep)


def test_keep_masks_can_gate_a_loss_that_is_backpropagated():
    g = torch.Generator().manual_seed(7)
    b = random_batch(g, 200)
    pi_lp = b.pi_logprob.clone().requires_grad_(True)
    keep = L.keep_masks(PolicyBatch(**{**b.__dict__, "pi_logprob": pi_lp}), ["dppo_binary_tv"])["dppo_binary_tv"]
    torch.where(keep, -b.advantages * pi_lp, 0.0).sum().backward()
    assert torch.equal(pi_lp.grad != 0, keep & (b.advantages != 0))


def test_the_catalogue_names_what_the_torch_side_has():
    import functools

    from trustscope.policy import MaskTerms

    assert tuple(PolicyBatch.__dataclass_fields__) == L.POLICY_BATCH_FIELDS
    terms = {n for n, v in vars(MaskTerms).items() if isinstance(v, functools.cached_property)} - {"valid"}
    assert terms <= family.SQL_COLUMNS, sorted(terms - family.SQL_COLUMNS)
    assert set(family.DIVERGENCES) == {"binary_tv", "binary_kl", "topk_tv", "topk_kl"}
    assert all(hasattr(MaskTerms, term) for pair in family.DIVERGENCES.values() for term in pair)


def test_every_term_a_mask_family_reads_is_computed_by_rule_blocks():
    """SQL_COLUMNS is the per-token vocabulary of the mask macros: every name is a column rule_blocks computes
    (or token_metrics_core, which it reads)."""
    import re

    from trustscope.query.catalogue import VIEW_DIR

    text = "".join((VIEW_DIR / f"{v}.sql").read_text() for v in ("rule_blocks", "token_metrics_core"))
    computed = set(re.findall(r"\bas ([a-z_][a-z0-9_]*)", text)) | set(re.findall(r"[a-z_][a-z0-9_]*", text))
    assert computed >= family.SQL_COLUMNS, sorted(family.SQL_COLUMNS - computed)
