"""verl's other policy losses: golden values (loss, metrics and gradient) recorded from verl's
own functions at b178a3cd (golden/record_verl_policy_losses.py, the same inputs), values and
gradients derived by hand, slow reference loops, and exact shares under accumulation."""

import importlib.util
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ppo_core import (
    POLICY_LOSS_HYPERPARAMETERS,
    POLICY_LOSS_MODES,
    POLICY_LOSSES,
    policy_loss,
    rejection_rules,
)


def _load(file: str, name: str):
    # pytest runs with --import-mode=importlib (this directory is not on sys.path): load the
    # siblings under names no other package's tests can shadow, as test_reference.py does
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_load("reference.py", "ppo_core_tests_reference")
ref = _load("reference_policy_losses.py", "ppo_core_tests_reference_policy_losses")

D = torch.float64
GOLDEN = json.loads((Path(__file__).parent / "golden/verl_b178a3cd_policy_losses.json").read_text())
LOGP = torch.tensor([[-1.2, -0.4, -2.1, -0.9, -0.3], [-0.6, -1.7, -0.2, -2.4, -1.1],
                     [-0.8, -1.0, -1.5, -3.1, -0.7]], dtype=D)  # fmt: skip
OLD = torch.tensor([[-1.0, -0.5, -2.6, -0.9, -0.6], [-0.9, -1.2, -0.3, -2.0, -1.5],
                    [-0.5, -1.4, -1.1, -2.9, -0.2]], dtype=D)  # fmt: skip
ADV = torch.tensor([[1.5, 1.5, 1.5, 1.5, 1.5], [-0.8, -0.8, -0.8, -0.8, -0.8],
                    [0.4, -1.1, 2.0, 0.3, -0.6]], dtype=D)  # fmt: skip
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=D)
W = torch.tensor([[1.0, 0.8, 1.3, 2.0, 0.5], [1.1, 0.9, 1.0, 0.7, 0.0],
                  [1.2, 1.0, 0.6, 0.0, 0.0]], dtype=D)  # fmt: skip
HYPER = {  # the golden cases' hyperparameters (verl's names)
    "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "gspo": dict(clip_ratio_low=0.05, clip_ratio_high=0.08),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": dict(),
    "clip_cov": dict(clip_cov_ratio=0.2, clip_cov_lb=0.02, clip_cov_ub=5.0),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    "geo_mean": dict(clip_ratio_low=0.2, clip_ratio_high=0.3),
    "cispo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
}
FORCED_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}  # verl's quirk


def test_the_registry_holds_verls_names() -> None:
    assert tuple(POLICY_LOSSES) == POLICY_LOSS_MODES == tuple(POLICY_LOSS_HYPERPARAMETERS)
    assert set(HYPER) | {"bypass_mode"} == set(POLICY_LOSS_MODES)


COMMON = {"logprob", "old_logprob", "advantages", "response_mask", "is_weights", "generator",
          "agg_mode", "global_num_tokens", "global_num_seqs", "dp_size", "loss_scale_factor",
          "aggregation", "kwargs"}  # fmt: skip


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_the_torch_free_table_lists_each_modes_own_keywords(mode: str) -> None:
    """A trainer checks its configuration against POLICY_LOSS_HYPERPARAMETERS: it must be the
    function's own keywords."""
    own = set(inspect.signature(POLICY_LOSSES[mode]).parameters) - COMMON
    assert own == set(POLICY_LOSS_HYPERPARAMETERS[mode])


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_matches_verl(case: str) -> None:
    mode, weighted, agg = case.split("|")
    logprob = LOGP.clone().requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws its tokens from the global generator, as verl
    loss, metrics = policy_loss(
        logprob, OLD, ADV, MASK, loss_mode=mode, agg_mode=FORCED_AGG.get(mode, agg),
        is_weights=W if weighted == "1" else None, **HYPER[mode],
    )  # fmt: skip
    loss.backward()
    want = GOLDEN[case]
    assert loss.item() == pytest.approx(want["loss"], abs=1e-6)
    for name, value in want["metrics"].items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-6), name
    assert torch.allclose(logprob.grad, torch.tensor(want["grad"], dtype=D), atol=1e-6)


def _grad(mode: str, logprob, old, adv, mask, **kw):
    logprob = logprob.clone().requires_grad_(True)
    loss, metrics = policy_loss(logprob, old, adv, mask, loss_mode=mode, **kw)
    loss.backward()
    return loss.item(), metrics, logprob.grad


def test_gspo_by_hand() -> None:
    # token log-ratios 0.1 and −0.1 average to 0: s = 1 on both tokens (a token-level ratio
    # would be e^0.1 on the first); ∂ℓ/∂log π_t = −A·s/|y| under seq-mean-token-mean
    logp, old = torch.tensor([[-1.0, -2.0]], dtype=D), torch.tensor([[-1.1, -1.9]], dtype=D)
    loss, metrics, grad = _grad(
        "gspo", logp, old, torch.full((1, 2), 2.0, dtype=D), torch.ones(1, 2)
    )
    assert loss == pytest.approx(-2.0) and metrics["pg_clipfrac"].item() == pytest.approx(0.0)
    assert torch.allclose(grad, torch.tensor([[-1.0, -1.0]], dtype=D))
    # both tokens +0.4: s = e^0.4 > 1.2, clipped, no gradient
    loss, metrics, grad = _grad(
        "gspo", logp, logp - 0.4, torch.ones(1, 2, dtype=D), torch.ones(1, 2)
    )
    assert loss == pytest.approx(-1.2) and metrics["pg_clipfrac"].item() == pytest.approx(1.0)
    assert torch.equal(grad, torch.zeros(1, 2, dtype=D))


def test_sapo_by_hand() -> None:
    # ρ = 1: the gate σ(0)·4/τ = 2/τ with slope 1, so ℓ = −2A/τ and ∂ℓ/∂log π = −A
    logp, one = torch.tensor([[-1.0, -2.0]], dtype=D), torch.ones(1, 2)
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    loss, _, grad = _grad("sapo", logp, logp, adv, one, agg_mode="token-mean")
    assert loss == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    assert torch.allclose(grad, torch.tensor([[-0.5, 0.5]], dtype=D))


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    # ρ = e^0.5 → weight sg(1.28); ℓ = −1.28·A·log π = 0.64 and ∂ℓ/∂log π = −1.28 (PPO's clip: 0)
    logp = torch.tensor([[-0.5]], dtype=D)
    loss, metrics, grad = _grad("cispo", logp, logp - 0.5, torch.ones(1, 1, dtype=D),
                                torch.ones(1, 1), clip_ratio_high=0.28)  # fmt: skip
    assert loss == pytest.approx(0.64) and metrics["pg_clipfrac"].item() == pytest.approx(1.0)
    assert grad.item() == pytest.approx(-1.28)
    _, _, ppo_grad = _grad("vanilla", logp, logp - 0.5, torch.ones(1, 1, dtype=D), torch.ones(1, 1),
                           clip_ratio_high=0.28)  # fmt: skip
    assert ppo_grad.item() == 0.0


def test_geo_mean_by_hand() -> None:
    logp, one = torch.tensor([[-1.0, -1.0]], dtype=D), torch.ones(1, 2)
    old = logp - torch.tensor([[0.5, -0.1]], dtype=D)  # log ρ = 0.5 and −0.1
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.3)
    # A = 1: 0.5 is clipped to 0.3 (no gradient); r = exp((0.3 − 0.1)/2); ∂/∂log π_2 = −r/2
    loss, metrics, grad = _grad("geo_mean", logp, old, torch.ones(1, 2, dtype=D), one, **kw)
    r = math.exp(0.1)
    assert loss == pytest.approx(-r) and metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert torch.allclose(grad, torch.tensor([[0.0, -r / 2]], dtype=D))
    # A = −1: pushing down, 0.5 stays (only a fall below −0.2 would be clipped)
    loss, metrics, grad = _grad("geo_mean", logp, old, -torch.ones(1, 2, dtype=D), one, **kw)
    r = math.exp(0.2)
    assert loss == pytest.approx(r) and metrics["pg_clipfrac_lower"].item() == pytest.approx(0.5)
    assert torch.allclose(grad, torch.tensor([[r / 2, r / 2]], dtype=D))


def test_gpg_is_the_plain_policy_gradient() -> None:
    logp = torch.tensor([[-0.5]], dtype=D)
    loss, _, grad = _grad(
        "gpg", logp, logp + 3.0, torch.full((1, 1), 2.0, dtype=D), torch.ones(1, 1)
    )
    assert loss == pytest.approx(1.0) and grad.item() == pytest.approx(-2.0)


def test_kl_cov_penalizes_the_top_covariance_token() -> None:
    # A = [1, 0, 0, −1] (mean 0), log π = [−1, −2, −2, −2.6] (mean −1.9): cov = [0.9, 0, 0, 0.7];
    # k = ⌊0.25·4⌋ = 1 picks token 0
    logp = torch.tensor([[-1.0, -2.0, -2.0, -2.6]], dtype=D)
    lr = torch.tensor([[0.2, 0.1, -0.1, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 0.0, 0.0, -1.0]], dtype=D)
    loss, metrics, _ = _grad("kl_cov", logp, logp - lr, adv, torch.ones(1, 4),
                             kl_cov_ratio=0.25, ppo_kl_coef=0.5)  # fmt: skip
    want = (-math.exp(0.2) + 0.5 * 0.2 + 0.0 + 0.0 + 1.0) / 4
    assert loss == pytest.approx(want)
    assert metrics["ppo_kl"].item() == pytest.approx(0.1)  # mean |log ρ|, as verl reports


def test_clip_cov_cuts_only_candidates_and_its_draw_follows_the_generator() -> None:
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 16, dtype=D, generator=g)
    old, adv = (
        logp + 0.05 * torch.randn(4, 16, dtype=D, generator=g),
        torch.randn(4, 16, dtype=D, generator=g),
    )
    mask = torch.ones(4, 16)
    kw = dict(clip_cov_ratio=0.05, clip_cov_lb=0.1, clip_cov_ub=5.0)  # k = ⌊0.05·64⌋ = 3
    cov = (adv - adv.mean()) * (logp - logp.mean())
    candidates = (cov > 0.1) & (cov < 5.0)
    draws = []
    for seed in (0, 0, 7):
        _, metrics, grad = _grad("clip_cov", logp, old, adv, mask,
                                 generator=torch.Generator().manual_seed(seed), **kw)  # fmt: skip
        cut = grad == 0
        assert int(cut.sum()) == 3 and bool(candidates[cut].all())
        assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 64)
        draws.append(cut)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


@pytest.mark.parametrize("seed", range(4))
def test_reference_loops(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(5, 9, dtype=D, generator=g) * 3
    old = logp + 0.3 * torch.randn(5, 9, dtype=D, generator=g)
    adv = torch.randn(5, 9, dtype=D, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.25).to(D)
    mask[:, 0] = 1.0
    cases = [
        ("gspo", {}, ref.ref_gspo_loss(logp, old, adv, mask)),
        ("sapo", {}, ref.ref_sapo_loss(logp, old, adv, mask)),
        ("cispo", {}, ref.ref_cispo_loss(logp, old, adv, mask)),
        ("geo_mean", {}, ref.ref_geo_mean_loss(logp, old, adv, mask)),
        ("kl_cov", {"kl_cov_ratio": 0.1}, ref.ref_kl_cov_loss(logp, old, adv, mask, ratio=0.1)),
    ]
    for mode, kw, want in cases:
        loss, _ = policy_loss(logp, old, adv, mask, loss_mode=mode, **kw)
        assert loss.item() == pytest.approx(want, abs=1e-9), mode


ACCUMULABLE = ["vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo", "bypass_mode"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ACCUMULABLE)
def test_micro_batch_shares_sum_to_the_global_loss(mode: str, agg: str) -> None:
    """Two "ranks" (dp_size 2), the first with two micro-batches: the shares, summed and
    divided by dp_size as DDP averages, give the whole batch's loss and gradient."""
    logp = torch.cat([LOGP, LOGP + 0.1]).requires_grad_(True)
    old, adv, mask = torch.cat([OLD, OLD - 0.2]), torch.cat([ADV, -ADV]), torch.cat([MASK, MASK])
    whole, _ = policy_loss(logp, old, adv, mask, loss_mode=mode, agg_mode=agg)
    (g_whole,) = torch.autograd.grad(whole, logp)
    counts = dict(global_num_tokens=mask.sum(), global_num_seqs=6, dp_size=2)
    total = (
        sum(
            policy_loss(logp[s], old[s], adv[s], mask[s], loss_mode=mode, agg_mode=agg, **counts)[0]
            for s in (slice(0, 1), slice(1, 3), slice(3, 6))
        )
        / 2
    )
    (g_parts,) = torch.autograd.grad(total, logp)
    # (token-mean without counts divides by N + 1e-8, as masked_mean: ~1e-10 relative)
    assert total.item() == pytest.approx(whole.item(), rel=1e-9)
    assert torch.allclose(g_parts, g_whole, rtol=1e-9, atol=1e-12)


def test_bypass_mode_reinforce_weighs_and_rejects() -> None:
    # old_logprob is π_rollout; w = min(π_θ/π_rollout, 2); a token with k1 outside the bounds
    # is dropped
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=D)
    rollout = logp - torch.tensor([[0.1, 1.0, -3.0]], dtype=D)
    adv = torch.ones(1, 3, dtype=D)
    rules = rejection_rules("token_k1", "0.1_10")  # keeps ratios in [0.1, 10]
    kw = dict(loss_type="reinforce", rollout_is="token", rollout_rs=rules)
    loss, metrics, grad = _grad("bypass_mode", logp, rollout, adv, torch.ones(1, 3), **kw)
    w = [math.exp(0.1), 2.0]  # e^1 truncated at 2; the third token (log ratio −3) rejected
    assert loss == pytest.approx((w[0] + w[1]) / 2)
    assert torch.allclose(grad, torch.tensor([[-w[0] / 2, -w[1] / 2, 0.0]], dtype=D))
    assert "rollout_rs_masked_fraction" in metrics and "rollout_is_mean" in metrics


def test_dispatch_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown loss_mode 'gspo2'.*vanilla, gspo"):
        policy_loss(LOGP, OLD, ADV, MASK, loss_mode="gspo2")
    with pytest.raises(TypeError, match="clip_ratio_c"):
        policy_loss(LOGP, OLD, ADV, MASK, loss_mode="gspo", clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(LOGP, OLD, ADV, MASK, loss_mode="bypass_mode", loss_type="ppo")
