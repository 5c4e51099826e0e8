"""Sequence rewards placed on tokens, DAPO's overlong penalty, and the reward model's pairwise
loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_ndim, check_same_shape


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


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, arXiv:2503.14476; verl's
    ``reward_model.overlong_buffer``): responses longer than L_max − L_buf lose reward
    linearly, up to ``penalty_factor`` at L_max.

    penalty = min(−(|y| − (L_max − L_buf)) / L_buf · factor, 0)

    Args:
        response_lengths: ``[B]`` tokens of each response (its EOS included).
        max_response_length: L_max.
        buffer_length: L_buf > 0, at most L_max.
        penalty_factor: the penalty at |y| = L_max.

    Returns:
        ``[B]`` penalties ≤ 0 (float32), to add to the sequence rewards.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, {max_response_length}], got {buffer_length}"
        )
    excess = response_lengths.float() - (max_response_length - buffer_length)
    return torch.clamp(-excess / buffer_length * penalty_factor, max=0.0)


def pairwise_reward_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry loss of a reward model on preference pairs (InstructGPT's RM loss,
    OpenRLHF's ``PairWiseLoss``, TRL's ``RewardTrainer`` with its centering term).

    loss = mean_b[ −log σ(r_c[b] − r_r[b] − m[b]) ] + c · mean_b[ (r_c[b] + r_r[b])² ]

    The margin ``m`` (Llama 2's: how much better the chosen response is rated) asks the
    chosen score to lead by at least ``m``; the centering term (``center_coef``, c; 0.01 in
    Eisenstein et al., 2023) keeps the scores near 0 — the loss sees only differences, so
    without it their level drifts freely.

    Args:
        chosen: ``[B]`` scores of the preferred responses.
        rejected: ``[B]`` scores of the other responses of the same prompts.
        margin: ``[B]`` or a number; None = 0.
        center_coef: c ≥ 0.

    Returns:
        ``(loss, metrics)``: the scalar loss (differentiable) and detached ``accuracy``
        (share of pairs with r_c > r_r; ties count as wrong), ``margin`` (mean r_c − r_r),
        ``chosen``/``rejected`` (mean scores).
    """
    check_ndim("chosen", chosen, 1, "[B]")
    check_same_shape(("chosen", chosen), ("rejected", rejected))
    if center_coef < 0:
        raise ValueError(f"center_coef must be >= 0, got {center_coef}")
    diff = chosen.float() - rejected.float()
    shifted = diff if margin is None else diff - torch.as_tensor(margin, device=diff.device)
    loss = -torch.nn.functional.logsigmoid(shifted).mean()
    if center_coef:
        loss = loss + center_coef * (chosen.float() + rejected.float()).pow(2).mean()
    metrics = {
        "accuracy": (diff > 0).float().mean().detach(),
        "margin": diff.mean().detach(),
        "chosen": chosen.float().mean().detach(),
        "rejected": rejected.float().mean().detach(),
    }
    return loss, metrics
