"""verl's other advantage estimators: golden values recorded from verl's own functions at
b178a3cd (golden/record_verl_advantages.py, the same inputs), values derived by hand, and the
registry of every name verl registers."""

import json
import math
from pathlib import Path

import pytest
import torch

from ppo_core import (
    ADVANTAGE_ESTIMATOR_NAMES,
    ADVANTAGE_ESTIMATORS,
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_optimal_token_baseline_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
)

D = torch.float64
GOLDEN = json.loads((Path(__file__).parent / "golden/verl_b178a3cd_advantages.json").read_text())
LENGTHS, SCORES = [5, 3, 4, 2, 5, 1], [1.0, 0.0, 0.5, 0.0, 2.0, -1.0]
MASK, REWARDS = torch.zeros(6, 5, dtype=D), torch.zeros(6, 5, dtype=D)
for i, (n, s) in enumerate(zip(LENGTHS, SCORES, strict=True)):
    MASK[i, :n], REWARDS[i, n - 1] = 1.0, s
S = torch.tensor(SCORES, dtype=D)
GROUPS = ["a", "a", "a", "b", "b", "c"]
HOLES = MASK.clone()
HOLES[0, 1] = HOLES[4, 2] = 0.0
OLD = -torch.linspace(0.1, 2.9, 30, dtype=D).reshape(6, 5)
SUM_PI2 = OLD.exp() ** 2 + torch.linspace(0.01, 0.3, 30, dtype=D).reshape(6, 5)
W = torch.linspace(0.6, 1.8, 30, dtype=D).reshape(6, 5)
BASELINES = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, -0.5], dtype=D)

OURS = {
    "grpo_passk": lambda: compute_grpo_passk_advantages(S[:5], GROUPS[:5], MASK[:5]),
    "reinforce_plus_plus_baseline": lambda: compute_reinforce_pp_baseline_advantages(
        S, GROUPS, MASK
    ),
    "opo": lambda: compute_opo_advantages(S, GROUPS, MASK),
    "gpg": lambda: compute_gpg_advantages(S, GROUPS, MASK, f_norm=2.0),
    "remax": lambda: compute_remax_advantages(REWARDS, BASELINES, MASK),
    "optimal_token_baseline": lambda: compute_optimal_token_baseline_advantages(
        REWARDS, GROUPS, MASK, OLD, SUM_PI2, W
    ),
    "optimal_token_baseline_zero_tail": lambda: compute_optimal_token_baseline_advantages(
        REWARDS, GROUPS, MASK, OLD, SUM_PI2, handle_zero_tail=True
    ),
    "tir_optimal_token_baseline": lambda: ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"](
        REWARDS * HOLES, GROUPS, HOLES, OLD, SUM_PI2
    ),
}


def test_the_registry_holds_verls_names() -> None:
    assert tuple(ADVANTAGE_ESTIMATORS) == ADVANTAGE_ESTIMATOR_NAMES
    assert set(GOLDEN) - {"optimal_token_baseline_zero_tail"} <= set(ADVANTAGE_ESTIMATOR_NAMES)


@pytest.mark.parametrize("name", sorted(OURS))
def test_matches_verl(name: str) -> None:
    advantages, returns = OURS[name]()
    assert torch.allclose(advantages, torch.tensor(GOLDEN[name]["advantages"], dtype=D), atol=1e-6)
    assert torch.allclose(returns, torch.tensor(GOLDEN[name]["returns"], dtype=D), atol=1e-6)


def test_passk_credits_only_the_best_of_each_group() -> None:
    # group a: 1, 0, 0.5 → the best gets (1 − 0.5)/std(1, 0, 0.5) = 0.5/0.5 = 1; the rest 0
    adv, _ = compute_grpo_passk_advantages(S[:3], [0, 0, 0], MASK[:3])
    assert adv[:, 0].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match=">= 2 responses"):
        compute_grpo_passk_advantages(S, GROUPS, MASK)  # group c has one


def test_opo_baseline_is_the_length_weighted_mean() -> None:
    # group a: lengths 5, 3, 4, scores 1, 0, 0.5 → b = (5 + 0 + 2)/12
    adv, _ = compute_opo_advantages(S[:3], [0, 0, 0], MASK[:3])
    assert adv[:, 0].tolist() == pytest.approx([1 - 7 / 12, -7 / 12, 0.5 - 7 / 12])


def test_gpg_rescales_by_the_share_of_nonzero_scores() -> None:
    # 4 of 6 scores are non-zero: α = 6/4; group b: mean 1 → A = 1.5·(0 − 1)/f_norm
    adv, _ = compute_gpg_advantages(S, GROUPS, MASK, f_norm=2.0)
    assert adv[3, 0].item() == pytest.approx(1.5 * -1.0 / 2.0)
    assert adv[5, 0].item() == pytest.approx(1.5 * -1.0 / 2.0)  # a group of one: mean 0


def test_remax_subtracts_the_greedy_score_from_the_return() -> None:
    adv, ret = compute_remax_advantages(REWARDS, BASELINES, MASK)
    assert ret[0].tolist() == [1.0] * 5 and adv[0].tolist() == [0.5] * 5
    assert adv[1].tolist() == [-0.5, -0.5, -0.5, 0.0, 0.0]


def test_otb_with_equal_weights_is_the_mean_return_at_each_position() -> None:
    """π = 1/2 everywhere and Σπ² = 1/2: every step adds the same W, so the baseline is
    the plain mean of the group's returns among the responses still running at t."""
    old = torch.full((2, 3), math.log(0.5), dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    rewards = torch.tensor([[0, 0, 2.0], [0, 1.0, 0]], dtype=D)
    adv, ret = compute_optimal_token_baseline_advantages(rewards, [0, 0], mask, old, old.exp())
    assert adv[0].tolist() == pytest.approx([0.5, 0.5, 0.0], abs=1e-7)  # t = 2: itself alone
    assert adv[1].tolist() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-7)


def test_reinforce_pp_baseline_whitens_the_centred_scores() -> None:
    adv, _ = compute_reinforce_pp_baseline_advantages(S, GROUPS, MASK)
    valid = adv[MASK.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-6)
