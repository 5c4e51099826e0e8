"""Masked reductions and whitening, with the arithmetic done by hand."""

import math

import pytest
import torch

from ppo_core import masked_mean, masked_sum, masked_var, masked_whiten

# Valid entries are 1, 2 (row 0) and 4 (row 1).
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_masked_sum_and_mean() -> None:
    assert masked_sum(X, M).item() == 7.0  # 1 + 2 + 4
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(X, M).item() == pytest.approx(7 / 3, rel=1e-8)  # 7 / (3 + 1e-8)
    assert masked_mean(X, M, dim=-1).tolist() == pytest.approx([1.5, 4.0], rel=1e-8)
    assert masked_mean(X, M, dim=0).tolist() == pytest.approx([2.5, 2.0, 0.0], rel=1e-8)


def test_all_masked_mean_is_zero_not_nan() -> None:
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var() -> None:
    # μ = 7/3; deviations -4/3, -1/3, 5/3; squares sum to 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(14 / 9, rel=1e-7)
    assert masked_var(X, M).item() == pytest.approx(7 / 3, rel=1e-7)  # (42/9) / (3 - 1)


@pytest.mark.parametrize("valid", [0, 1])
def test_unbiased_var_needs_two_entries(valid: int) -> None:
    mask = torch.zeros_like(M)
    mask.view(-1)[:valid] = True
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        masked_var(X, mask)


def test_masked_whiten() -> None:
    std = math.sqrt(7 / 3 + 1e-8)
    white = masked_whiten(X, M)
    assert white[0, 0].item() == pytest.approx((1 - 7 / 3) / std)  # -0.8729
    assert white[1, 0].item() == pytest.approx((4 - 7 / 3) / std)  # +1.0911
    # masked positions are transformed too, not zeroed
    assert white[1, 2].item() == pytest.approx((6 - 7 / 3) / std)
    scaled = masked_whiten(X, M, shift_mean=False)
    assert scaled[0, 0].item() == pytest.approx((1 - 7 / 3) / std + 7 / 3)
    # not exactly 0: μ = 7 / (3 + 1e-8) sits 7.8e-9 below the true mean 7/3
    assert masked_mean(white, M).item() == pytest.approx(0.0, abs=1e-8)
    assert masked_var(white, M).item() == pytest.approx(1.0, rel=1e-6)


def test_shape_mismatch_names_both_arguments() -> None:
    with pytest.raises(ValueError, match=r"`mask` has shape \(2, 2\) but `x` has shape \(2, 3\)"):
        masked_mean(X, M[:, :2])
