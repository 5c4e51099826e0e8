"""token_level_scores: a sequence's score on its last valid response token."""

import math

import pytest
import torch

from ppo_core import pairwise_reward_loss, token_level_scores


def test_scores_sit_on_the_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = token_level_scores([0.5, -1.0, 3.0, 2.0], mask)
    expected = torch.tensor(
        [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2.0]], dtype=torch.float32
    )
    assert torch.equal(out, expected)  # the all-padding row drops its score


def test_a_gap_in_the_mask_keeps_the_last_valid_token() -> None:
    # an observation token masked out inside a response: the score still goes to the end
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    assert token_level_scores(torch.tensor([7.0]), mask).tolist() == [[0, 0, 0, 7.0, 0]]


def test_shapes_are_checked() -> None:
    mask = torch.ones(4, 3)
    assert token_level_scores(torch.ones(4), mask[:, :0]).shape == (4, 0)
    with pytest.raises(ValueError, match=r"scores \(3,\) must be \[B\] = \[4\]"):
        token_level_scores([1.0, 2.0, 3.0], mask)
    with pytest.raises(ValueError, match=r"response_mask.*\[B, T\]"):
        token_level_scores([1.0], torch.ones(3))


# pairwise_reward_loss: −log σ(r_c − r_r − m), mean over pairs, + c·mean((r_c + r_r)²)


def test_pairwise_loss_by_hand() -> None:
    # differences 2, 0, −1: −log σ(2) = log(1 + e⁻²) = 0.126928, log 2 = 0.693147,
    # log(1 + e¹) = 1.313262; mean 0.711112
    chosen = torch.tensor([3.0, 1.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.0])
    loss, metrics = pairwise_reward_loss(chosen, rejected)
    assert loss.item() == pytest.approx(0.711112, abs=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(1 / 3)  # the tie counts as wrong
    assert metrics["margin"].item() == pytest.approx(1 / 3)
    assert metrics["chosen"].item() == pytest.approx(4 / 3)
    assert metrics["rejected"].item() == pytest.approx(1.0)
    assert not any(m.requires_grad for m in metrics.values())
    loss.backward()  # d/dr_c −log σ(d) = −σ(−d) / B: −0.119203/3, −0.5/3, −0.731059/3
    expected = torch.tensor([-0.119203, -0.5, -0.731059]) / 3
    assert torch.allclose(chosen.grad, expected, atol=1e-6)


def test_pairwise_loss_margin_and_centering_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0])
    # margin [1, 0]: differences 2−1 = 1 and 0: (log(1 + e⁻¹) + log 2) / 2 = 0.503204
    loss, _ = pairwise_reward_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(0.503204, abs=1e-6)
    # a number margin applies to every pair: (log(1 + e⁻¹·⁵) + log(1 + e⁰·⁵)) / 2
    loss, _ = pairwise_reward_loss(chosen, rejected, margin=0.5)
    assert loss.item() == pytest.approx((0.201413 + 0.974077) / 2, abs=1e-6)
    # centering c = 0.01: sums 2 and 2 → +0.01 · 4 on (log(1 + e⁻²) + log 2) / 2 = 0.410038
    loss, _ = pairwise_reward_loss(chosen, rejected, center_coef=0.01)
    assert loss.item() == pytest.approx(0.410038 + 0.04, abs=1e-6)


def test_pairwise_loss_matches_a_reference_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    chosen, rejected, margin = (torch.randn(64, generator=gen) * 3 for _ in range(3))
    loss, metrics = pairwise_reward_loss(chosen, rejected, margin.abs(), center_coef=0.05)
    terms = [
        math.log(1 + math.exp(-(c - r - abs(m)))) + 0.05 * (c + r) ** 2
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)
    ]
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    hits = sum(c > r for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True))
    assert metrics["accuracy"].item() == pytest.approx(hits / 64)


def test_pairwise_loss_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="rejected"):
        pairwise_reward_loss(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match=r"chosen.*\[B\]"):
        pairwise_reward_loss(torch.ones(3, 1), torch.ones(3, 1))
    with pytest.raises(ValueError, match="center_coef"):
        pairwise_reward_loss(torch.ones(3), torch.ones(3), center_coef=-1.0)


def test_overlong_penalty_by_hand() -> None:
    # L_max 20, buffer 8: free up to 12 tokens, then −(|y| − 12)/8 · 1.0, reaching −1 at 20
    from ppo_core import overlong_penalty

    lengths = torch.tensor([5, 12, 13, 16, 20])
    got = overlong_penalty(lengths, max_response_length=20, buffer_length=8, penalty_factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.5, -1.0])
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_response_length=20, buffer_length=21, penalty_factor=1.0)
