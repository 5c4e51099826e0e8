"""The algorithm stage composes ppo_core exactly as configured."""

import pytest
import torch

from klppo_train.config.schema import AlgorithmConfig, KLControlConfig
from klppo_train.ppo.algorithm import KLInReward, make_advantage_fn, make_kl_controller
from ppo_core import AdaptiveKLController, compute_gae, compute_grpo_advantages

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
SCORES = torch.tensor([[0, 0, 1.0, 0], [0, 0.0, 0, 0], [0, 0, 0, 1.0], [0.5, 0, 0, 0]])


def test_kl_in_reward_moves_the_adaptive_coefficient() -> None:
    cfg = AlgorithmConfig(
        use_kl_in_reward=True,
        kl_penalty="k1",
        kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=40),
    )
    ctl = make_kl_controller(cfg)
    assert isinstance(ctl, AdaptiveKLController)
    old = torch.full((4, 4), -1.0)
    ref = old - 0.2  # Δ = 0.2 on every token → KL metric 0.2
    rewards, metrics = KLInReward(cfg.kl_penalty, ctl)(SCORES, old, ref, MASK)
    torch.testing.assert_close(rewards, SCORES - 0.1 * 0.2 * MASK)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.2)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # e = clip(0.2 / 0.05 − 1, ±0.2) = 0.2; β ← 0.1 · (1 + 0.2 · 4 / 40)
    assert ctl.value == pytest.approx(0.1 * 1.02)


def test_estimators_dispatch_to_ppo_core() -> None:
    values = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    gae = make_advantage_fn(AlgorithmConfig(adv_estimator="gae", lam=0.9))(
        SCORES, MASK, values=values
    )
    for got, want in zip(gae, compute_gae(SCORES, values, MASK, 1.0, 0.9), strict=True):
        torch.testing.assert_close(got, want)
    groups = torch.tensor([0, 0, 1, 1])
    grpo = make_advantage_fn(AlgorithmConfig(adv_estimator="grpo"))(SCORES, MASK, group_ids=groups)
    want = compute_grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.5]), groups, MASK)
    torch.testing.assert_close(grpo[0], want[0])
    rloo, _ = make_advantage_fn(AlgorithmConfig(adv_estimator="rloo"))(
        SCORES, MASK, group_ids=groups
    )
    assert rloo[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.5, -0.5])  # s_i − other's score
    with pytest.raises(ValueError, match="needs critic values"):
        make_advantage_fn(AlgorithmConfig(adv_estimator="gae"))(SCORES, MASK)
    with pytest.raises(ValueError, match="needs the prompt index"):
        make_advantage_fn(AlgorithmConfig(adv_estimator="grpo"))(SCORES, MASK)
