"""Sequence rewards placed on tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_ndim


def token_level_scores(
    scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Place each sequence's score on its last valid response token (verl's
    ``token_level_scores``): the reward of an outcome arrives when the response ends.

    out[b, t] = scores[b] if t = max{t' : m[b, t'] = 1} else 0.

    Args:
        scores: ``[B]`` one score per sequence (a reward function's or a reward model's).
        response_mask: ``[B, T]``, nonzero on valid response tokens.

    Returns:
        ``[B, T]`` float32; a row with no valid token stays all zero (its score is dropped).
    """
    check_ndim("response_mask", response_mask, 2, "[B, T]")
    device = response_mask.device
    scores = torch.as_tensor(scores, dtype=torch.float32, device=device)
    batch, width = response_mask.shape
    if scores.shape != (batch,):
        raise ValueError(f"scores {tuple(scores.shape)} must be [B] = [{batch}]")
    out = torch.zeros(batch, width, dtype=torch.float32, device=device)
    if width == 0:  # max() over an empty dim would raise
        return out
    positions = torch.arange(width, device=device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=1).values
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out
