"""Rollout correction: golden values from verl's ``rollout_corr_helper`` (HEAD b178a3cd, its
functions run on this input in float64), hand-derived values, and a toy problem whose answer is
known in closed form."""

import math

import pytest
import torch

from ppo_core import (
    normalize_is_weights,
    off_policy_metrics,
    policy_loss,
    rejection_mask,
    rejection_rules,
    rollout_is_weights,
)

D = torch.float64
OLD = torch.tensor(
    [[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.8, -0.1, -2.5], [-0.9, -0.9, -1.6, -3.0]], dtype=D
)
ROLLOUT = torch.tensor(
    [[-1.1, -0.3, -2.3, -0.3], [-2.2, -0.3, -0.9, -2.1], [-0.3, -1.4, -2.8, -2.0]], dtype=D
)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])  # row 2 ends in padding
# OLD - ROLLOUT = [[0.1, -0.2, 0.3, 0], [1.5, -1.5, 0.8, -0.4], [-0.6, 0.5, 1.2, pad]]

IS_CASES = {  # verl's weights and metrics, threshold 2.0
    "token": (
        [[1.1051709, 0.81873075, 1.3498588, 1], [2, 0.22313016, 2, 0.67032005]]
        + [[0.54881164, 1.6487213, 2, 0]],
        {"rollout_is_mean": 1.5810991, "rollout_is_max": 4.4816891},
        {"rollout_is_min": 0.22313016, "rollout_is_ratio_fraction_high": 0.27272727},
        {"rollout_is_ratio_fraction_low": 0.090909091, "rollout_is_std": 0.56528714},
        {"rollout_is_eff_sample_size": 0.82796919},
    ),
    "sequence": (
        [[1.2214028] * 4, [1.4918247] * 4, [2, 2, 2, 0]],
        {"rollout_is_mean": 1.8059462, "rollout_is_max": 3.004166},
        {"rollout_is_min": 1.2214028, "rollout_is_ratio_fraction_high": 0.33333334},
        {"rollout_is_ratio_fraction_low": 0.0, "rollout_is_std": 0.30887049},
        {"rollout_is_eff_sample_size": 0.96094412},
    ),
}
NORMALIZED = {  # verl's, rollout_is_batch_normalize=True
    "token": (
        [[0.90962315, 0.6738654, 1.1110162, 0.82306106]]
        + [[1.6461221, 0.18364975, 1.6461221, 0.55171433], [0.45170549, 1.3569983, 1.6461221, 0]],
        1.2149767,
    ),
    "sequence": ([[0.77743082] * 4, [0.94955615] * 4, [1.273013] * 3 + [0]], 1.5710758),
}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_match_verl(level: str) -> None:
    expected, *metric_parts = IS_CASES[level]
    weights, metrics = rollout_is_weights(OLD, ROLLOUT, MASK, level=level, threshold=2.0)
    assert weights.flatten().tolist() == pytest.approx(sum(expected, []), rel=1e-7)
    assert not weights.requires_grad
    for part in metric_parts:
        for name, value in part.items():
            assert metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-9), name


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalized_weights_match_verl(level: str) -> None:
    expected, factor = NORMALIZED[level]
    weights, _ = rollout_is_weights(OLD, ROLLOUT, MASK, level=level, threshold=2.0)
    normalized, metrics = normalize_is_weights(weights, MASK, level=level)
    assert normalized.flatten().tolist() == pytest.approx(sum(expected, []), rel=1e-7)
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(factor, rel=1e-7)


def test_batch_normalization_over_ranks_sums_both_parts() -> None:
    """Hand-derived: with ``dp_sum`` doubling (two ranks holding this batch), the mean is the
    same; with a sum that adds 11 tokens of weight 0, μ halves."""
    weights, _ = rollout_is_weights(OLD, ROLLOUT, MASK, threshold=2.0)
    alone = normalize_is_weights(weights, MASK)[1]["rollout_is_batch_norm_factor"]
    twice = normalize_is_weights(weights, MASK, dp_sum=lambda x: 2 * x)[1]
    assert twice["rollout_is_batch_norm_factor"].item() == pytest.approx(alone.item())
    other = normalize_is_weights(weights, MASK, dp_sum=lambda x: x if x.item() > 11 else 2 * x)
    assert other[1]["rollout_is_batch_norm_factor"].item() == pytest.approx(alone.item() / 2)


RS_CASES = [  # verl's rollout_rs, rollout_rs_threshold → modified mask and metrics
    ("token_k1", "0.5_5.0", [[1, 1, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0]],
     {"rollout_rs_token_k1_mean": -0.15454545, "rollout_rs_token_k1_masked_fraction": 0.27272727,
      "rollout_rs_masked_fraction": 0.27272727, "rollout_rs_seq_masked_fraction": 0.66666669}),
    ("token_k1", 2.0, [[1, 1, 1, 1], [0, 0, 0, 1], [1, 1, 0, 0]],
     {"rollout_rs_token_k1_masked_fraction": 0.36363636,
      "rollout_rs_masked_fraction": 0.36363636, "rollout_rs_seq_masked_fraction": 0.66666669}),
    ("token_k2", 0.5, [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]],
     {"rollout_rs_token_k2_mean": 0.34045455, "rollout_rs_token_k2_masked_fraction": 0.27272727}),
    ("token_k3", 0.5, [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]],
     {"rollout_rs_token_k3_mean": 0.42655368, "rollout_rs_token_k3_masked_fraction": 0.27272727}),
    ("seq_sum_k1", "0.5_2.0", [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]],
     {"rollout_rs_seq_sum_k1_mean": -0.51818182, "rollout_rs_seq_masked_fraction": 0.33333334}),
    ("seq_sum_k2", 1.0, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_sum_k2_mean": 1.2686364, "rollout_rs_masked_fraction": 0.63636364}),
    ("seq_sum_k3", 1.0, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_sum_k3_mean": 1.5773375, "rollout_rs_masked_fraction": 0.63636364}),
    ("seq_mean_k1", "0.8_1.25", [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]],
     {"rollout_rs_seq_mean_k1_mean": -0.15454545, "rollout_rs_masked_fraction": 0.27272727}),
    ("seq_mean_k2", 0.3, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_mean_k2_mean": 0.34045454}),
    ("seq_mean_k3", 0.3, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_mean_k3_mean": 0.42655368}),
    ("seq_max_k2", 0.5, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_max_k2_mean": 0.62181818}),
    ("seq_max_k3", 0.5, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_seq_max_k3_mean": 1.0442311}),
    ("token_k1,seq_max_k3", "0.5_2.0,1.0", [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     {"rollout_rs_token_k1_masked_fraction": 0.36363636,
      "rollout_rs_seq_max_k3_masked_fraction": 0.63636364,
      "rollout_rs_masked_fraction": 0.63636364, "rollout_rs_seq_masked_fraction": 0.66666669}),
]  # fmt: skip


@pytest.mark.parametrize(("options", "threshold", "expected", "expected_metrics"), RS_CASES)
def test_rejection_masks_match_verl(options, threshold, expected, expected_metrics) -> None:
    mask, metrics = rejection_mask(OLD, ROLLOUT, MASK, rejection_rules(options, threshold))
    assert mask.tolist() == expected and mask.dtype == MASK.dtype
    for name, value in expected_metrics.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-6), name


def test_icepop_window_is_on_the_inverse_ratio() -> None:
    """verl's k1 bounds are on k1 = log π_rollout/π_old: "0.5_5.0" keeps ratios in
    [0.2, 2.0] (0.2231 kept, 2.2255 rejected); "0.2_2.0" keeps [0.5, 5.0]."""
    ratio = torch.tensor([[0.2231, 0.45, 2.2255, 4.9, 5.1]], dtype=D)
    old, rollout, mask = ratio.log(), torch.zeros_like(ratio), torch.ones_like(ratio)
    kept = rejection_mask(old, rollout, mask, rejection_rules("token_k1", "0.5_5.0"))[0]
    assert kept.tolist() == [[1, 1, 0, 0, 0]]
    kept = rejection_mask(old, rollout, mask, rejection_rules("token_k1", "0.2_2.0"))[0]
    assert kept.tolist() == [[0, 0, 1, 1, 0]]


def test_off_policy_metrics_match_verl() -> None:
    metrics = off_policy_metrics(OLD, ROLLOUT, MASK)
    verl = {"kl": -0.15454545, "k3_kl": 0.42655368, "chi2_token": 3.0267436}
    verl["chi2_seq"] = 3.2474597
    for name, value in verl.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-6), name


def test_equal_policies_give_unit_weights_and_keep_everything() -> None:
    weights, metrics = rollout_is_weights(OLD, OLD, MASK, level="sequence")
    assert torch.equal(weights, MASK.to(D))
    assert metrics["rollout_is_eff_sample_size"].item() == pytest.approx(1.0)
    rules = rejection_rules("token_k1,seq_max_k3", "0.99_1.01,1e-6")
    assert torch.equal(rejection_mask(OLD, OLD, MASK, rules)[0], MASK)
    assert off_policy_metrics(OLD, OLD, MASK)["chi2_seq"].item() == 0.0


def test_weights_scale_the_per_token_policy_loss() -> None:
    """Hand-derived: ratio 1 and A = 1 give ℓ = −1 per token; weights w make it −w, so the
    token-mean loss is −mean(w)."""
    logprob = OLD.clone().requires_grad_()
    advantages = torch.ones_like(OLD)
    weights, _ = rollout_is_weights(OLD, ROLLOUT, MASK, threshold=2.0)
    plain, _ = policy_loss(logprob, OLD, advantages, MASK)
    weighted, _ = policy_loss(logprob, OLD, advantages, MASK, is_weights=weights)
    assert plain.item() == pytest.approx(-1.0)
    valid = weights[MASK.bool()]
    assert weighted.item() == pytest.approx(-valid.mean().item())
    weighted.backward()
    assert logprob.grad[0, 0].item() == pytest.approx(-weights[0, 0].item() / 11)


def test_weights_recover_the_expectation_under_another_temperature() -> None:
    """The engine samples at temperature 2, the trainer's policy is temperature 1: E_π[f]
    is known in closed form (Σ π_k f_k); the plain sample mean misses it, the importance
    weights (untruncated) recover it, and self-normalized (batch-normalized) too."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0], dtype=D)
    f = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], dtype=D)
    log_pi, log_q = logits.log_softmax(-1), (logits / 2).log_softmax(-1)
    truth = (log_pi.exp() * f).sum().item()
    x = torch.multinomial(log_q.exp(), 200_000, replacement=True, generator=g)
    old, rollout = log_pi[x][:, None], log_q[x][:, None]
    mask = torch.ones_like(old)
    weights, _ = rollout_is_weights(old, rollout, mask, threshold=1e9)
    plain = f[x].mean().item()
    estimate = (weights[:, 0] * f[x]).mean().item()
    normalized = normalize_is_weights(weights, mask)[0]
    self_normalized = (normalized[:, 0] * f[x]).mean().item()
    assert abs(plain - truth) > 0.4  # sampling at T=2 spreads mass to the costly tokens
    assert estimate == pytest.approx(truth, abs=0.02)
    assert self_normalized == pytest.approx(truth, abs=0.02)
    assert math.isfinite(truth)


@pytest.mark.parametrize(
    ("options", "threshold", "message"),
    [
        ("token_k4", 1.0, "options are"),
        ("token_k2", "0.5_2.0", "no lower bound"),
        ("token_k1", "5.0_0.5", "0 < lower < upper"),
        ("token_k1", None, "needs rollout_rs_threshold"),
        ("token_k1,token_k2", "1,2,3", "one per option"),
        ("token_k3", -1.0, "> 0"),
    ],
)
def test_bad_rejection_specs_name_the_problem(options, threshold, message) -> None:
    with pytest.raises(ValueError, match=message):
        rejection_rules(options, threshold)


def test_bad_is_arguments() -> None:
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(OLD, ROLLOUT, MASK, level="geometric")
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(OLD, ROLLOUT, MASK, threshold=0.0)
    with pytest.raises(ValueError, match="shape"):
        rollout_is_weights(OLD, ROLLOUT[:, :3], MASK)
