"""Masked reductions and whitening.

Notation: ``x`` is any tensor, ``m`` a mask of the same shape (1 = valid, 0 = padding;
bool or float). Reductions use ``Σm + 1e-8`` as the denominator, so an all-masked input
gives 0 instead of NaN (the convention verl and TRL use, kept for exact comparison).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppo_core._checks import check_same_shape, mask_as

_EPS = 1e-8
# Sums a tensor over the data-parallel ranks, e.g. ``torch.distributed.all_reduce`` on a copy.
SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m over ``dim`` (all elements when ``None``).

    Args:
        x: values, any shape ``S``.
        mask: shape ``S``.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``S`` with ``dim`` removed, or a scalar.
    """
    check_same_shape(("x", x), ("mask", mask))
    masked = x * mask_as(mask, x)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / (Σ m + 1e-8) over ``dim`` (all elements when ``None``).

    Args:
        x: values, any shape ``S``.
        mask: shape ``S``.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``S`` with ``dim`` removed, or a scalar. Rows with no valid entry give 0.
    """
    total = masked_sum(x, mask, dim)
    m = mask_as(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / (count + _EPS)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    *,
    dp_sum: SumOverRanks | None = None,
) -> torch.Tensor:
    """Variance of the valid entries of ``x`` over the whole tensor.

    σ² = mean_m((x − μ)²) with μ = mean_m(x); ``unbiased`` applies Bessel's
    correction Σm / (Σm − 1).

    Args:
        x: values, any shape ``S``.
        mask: shape ``S``.
        unbiased: apply Bessel's correction.
        dp_sum: under data parallelism, sums a tensor over the ranks (an all-reduce): μ and
            σ² are then over every rank's entries (two all-reduced passes).

    Returns:
        Scalar tensor.

    Raises:
        ValueError: ``unbiased`` and fewer than 2 valid entries (the estimate is undefined).
    """
    if dp_sum is not None:
        return _global_mean_var(x, mask, dp_sum, unbiased)[1]
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    count = mask_as(mask, x).sum()
    _check_two_entries(count)
    return var * count / (count - 1)


def _check_two_entries(count: torch.Tensor) -> None:
    # A host read, but only to refuse undefined input; the math itself stays on device.
    if count.item() < 2:
        raise ValueError(
            f"masked_var(unbiased=True) needs at least 2 valid entries in `mask`, "
            f"got {count.item():g}"
        )


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    dp_sum: SumOverRanks | None = None,
) -> torch.Tensor:
    """Normalize ``x`` by the masked mean and unbiased masked variance of the whole batch.

    w = (x − μ) · rsqrt(σ² + 1e-8); with ``shift_mean=False`` μ is added back,
    w = (x − μ) · rsqrt(σ² + 1e-8) + μ (scale only).

    Args:
        x: values, any shape ``S`` (typically ``[B, T]``).
        mask: shape ``S``.
        shift_mean: centre the result at 0.
        dp_sum: under data parallelism, a function that sums a tensor over the ranks (an
            all-reduce): μ and σ² are then those of the whole batch on all ranks (verl
            whitens the global batch), not of this rank's slice. μ = Σx·m / Σm, then
            σ² = Σ(x − μ)²·m / (Σm − 1), each sum over all ranks.

    Returns:
        Shape ``S``. Entries outside the mask are transformed too (they are not zeroed).

    Raises:
        ValueError: fewer than 2 valid entries (over all ranks).
    """
    if dp_sum is None:
        mean = masked_mean(x, mask)
        var = masked_var(x, mask, unbiased=True)
    else:
        mean, var = _global_mean_var(x, mask, dp_sum)
    whitened = (x - mean) * torch.rsqrt(var + _EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _global_mean_var(
    x: torch.Tensor, mask: torch.Tensor, dp_sum: SumOverRanks, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and variance over every rank's entries (two passes, like
    :func:`masked_var`, so one rank gives the same numbers)."""
    check_same_shape(("x", x), ("mask", mask))
    m = mask_as(mask, x)
    count_and_sum = dp_sum(torch.stack([m.sum(), (x * m).sum()]))
    count = count_and_sum[0]
    mean = count_and_sum[1] / (count + _EPS)
    var = dp_sum(((x - mean) ** 2 * m).sum()) / (count + _EPS)
    if unbiased:
        _check_two_entries(count)
        var = var * count / (count - 1)
    return mean, var
