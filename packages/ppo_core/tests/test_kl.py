"""KL estimators, the KL reward penalty and the KL controllers, with hand-derived values."""

import math

import pytest
import torch

from ppo_core import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)

# Δ = logprob − ref_logprob = [+1, −1, −30, +30]
LOGPROB = torch.tensor([[-1.0, -2.0, -31.0, -1.0]], dtype=torch.float64)
REF = torch.tensor([[-2.0, -1.0, -1.0, -31.0]], dtype=torch.float64)


def test_estimator_hand_values() -> None:
    e = math.e
    expected = {
        "k1": [1.0, -1.0, -30.0, 30.0],
        "abs": [1.0, 1.0, 30.0, 30.0],
        "k2": [0.5, 0.5, 450.0, 450.0],  # ½Δ²
        # κ = clamp(−Δ, ±20): −1 → e^-1 + 1 − 1; 1 → e − 2; 20 → e^20 − 21 → clamped to 10;
        # −20 → e^-20 + 19 → clamped to 10
        "k3": [1 / e, e - 2, 10.0, 10.0],
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for name in [*expected, *aliases]:
        got = kl_penalty(LOGPROB, REF, name)[0].tolist()
        assert got == pytest.approx(expected[aliases.get(name, name)]), name


@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_straight_through_has_named_value_and_k2_gradient(name: str) -> None:
    logprob = torch.tensor([[-1.0, -2.0, -0.3, -4.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, -0.5, -1.0]], dtype=torch.float64)
    plus = kl_penalty(logprob, ref, name + "+")
    torch.testing.assert_close(plus, kl_penalty(logprob, ref, name))
    (grad,) = torch.autograd.grad(plus.sum(), logprob)
    # d/dlogprob ½Δ² = Δ
    torch.testing.assert_close(grad, (logprob - ref).detach())


def test_k3_gradient_differs_from_k3_plus() -> None:
    # The "+" variant only makes sense if it changes something: k3's own gradient is 1 − e^κ.
    logprob = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0]], dtype=torch.float64)
    (grad,) = torch.autograd.grad(kl_penalty(logprob, ref, "k3").sum(), logprob)
    assert grad.item() == pytest.approx(1 - math.exp(-1))  # not Δ = 1


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*low_var_kl\\+"):
        kl_penalty(LOGPROB, REF, "k4")
    assert "k3+" in KL_ESTIMATORS and "mse" in KL_ESTIMATORS


def test_apply_kl_penalty_hand_values() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    ref = torch.tensor([[-1.5, -1.0, -2.0], [-2.0, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # Δ = [[0.5, 0, 1], [1, 0, 2]]; the 2 is masked out.
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 0.9], [-0.1, 2.0, 0.0]]))
    # per-sequence mean KL: 1.5 / 3 = 0.5 and 1 / 2 = 0.5
    assert metrics["kl"].item() == pytest.approx(0.5)
    assert metrics["kl_coef"].item() == pytest.approx(0.1)
    assert not metrics["kl"].requires_grad


def test_apply_kl_penalty_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="`ref_logprob` has shape"):
        apply_kl_penalty(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 0.1
        )


def test_adaptive_controller_hand_values_and_checkpoint() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=1000)  # e = clip(12/6 − 1) = 0.2; × (1 + 0.2·0.1)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=torch.tensor(5.4), n_steps=1000)  # e = −0.1; × (1 − 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(ctl.state_dict())
    restored.update(6.6, 500)
    ctl.update(6.6, 500)
    assert restored.value == ctl.value and restored.state_dict() == ctl.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_kl_coef": 0.1, "target_kl": 6.0, "horizon": 0}, "horizon"),
        ({"init_kl_coef": 0.0, "target_kl": 6.0, "horizon": 10}, "init_kl_coef"),
        ({"init_kl_coef": 0.1, "target_kl": -1.0, "horizon": 10}, "target_kl"),
    ],
)
def test_adaptive_controller_validates(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)


def test_adaptive_controller_refuses_steps_that_could_flip_sign() -> None:
    ctl = AdaptiveKLController(0.1, 6.0, horizon=100)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(0.0, n_steps=500)  # 1 − 0.2·5 = 0


def test_fixed_controller() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 10**6)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_straight_through_survives_huge_differences() -> None:
    # ½Δ² overflows float32 at |Δ| ≈ 1.8e19; k2 − sg(k2) would then be inf − inf = NaN.
    logprob = torch.tensor([[-1e30, 0.0]], requires_grad=True)
    ref = torch.zeros(1, 2)
    value = kl_penalty(logprob, ref, "k3+")
    assert value.tolist() == [[10.0, 0.0]]
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    torch.testing.assert_close(grad, logprob.detach())  # Δ = logprob − 0
