"""Advantage estimators: GAE (with a critic), GRPO and RLOO (group baselines), REINFORCE++.

Notation: ``B`` sequences, ``T`` response tokens, ``m`` the response mask (1 = token the
policy generated; 0 = padding, or an observation/tool token inside a multi-turn response).
Masks are binary. All functions return ``(advantages, returns)``, both ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape
from ppo_core.masked import SumOverRanks, masked_whiten


def _gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Raw (un-whitened) GAE advantages ``[B, T]``; masked positions carry the next valid one's."""
    # Time-major copies make every step touch contiguous memory.
    r_tb, v_tb, valid_tb = (x.t().contiguous() for x in (rewards, values, valid))
    out_tb = torch.empty_like(r_tb)
    running = r_tb.new_zeros(r_tb.shape[1])  # A of the next valid token
    next_value = torch.zeros_like(running)  # V of the next valid token
    decay = gamma * lam
    for t in range(r_tb.shape[0] - 1, -1, -1):
        delta = r_tb[t] + gamma * next_value - v_tb[t]
        running = torch.where(valid_tb[t], delta + decay * running, running)
        next_value = torch.where(valid_tb[t], v_tb[t], next_value)
        out_tb[t] = running
    return out_tb.t()


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    dp_sum: SumOverRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016), whitened over the batch.

    Reverse scan over valid tokens: δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next,
    where V_next / A_next are the value / advantage of the next *valid* token (0 past the
    end). At masked positions both carry over unchanged, so observation tokens inside a
    response are skipped. returns = A + V (before whitening); advantages are then
    ``masked_whiten``-ed. Values at masked positions are not meaningful.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (score and KL penalty already folded in).
        values: ``[B, T]`` critic values V_t.
        response_mask: ``[B, T]`` binary mask.
        gamma: discount γ.
        lam: GAE λ.
        dp_sum: sums over data-parallel ranks: whiten over the whole batch
            (:func:`~ppo_core.masked_whiten`).

    Returns:
        ``(advantages, returns)``, both ``[B, T]``.
    """
    check_ndim("token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(
        ("token_rewards", token_rewards), ("values", values), ("response_mask", response_mask)
    )
    check_floating(("token_rewards", token_rewards), ("values", values))
    with torch.no_grad():
        advantages = _gae_scan(token_rewards, values, response_mask.bool(), gamma, lam)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask, dp_sum=dp_sum)
    return advantages, returns


def _group_index(group_ids: torch.Tensor | Sequence, batch: int, device) -> torch.Tensor:
    """Dense group number ``[B]`` (0..G-1) for arbitrary hashable or integer-tensor ids."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(
                f"`group_ids` has shape {tuple(group_ids.shape)} but `scores` has shape ({batch},)"
            )
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"`group_ids` has {len(ids)} entries but `scores` has {batch}")
    numbering: dict = {}
    dense = [numbering.setdefault(key, len(numbering)) for key in ids]
    return torch.tensor(dense, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, group: torch.Tensor):
    """Per-sample group size, group sum and unbiased group variance, each ``[B]``."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, group, torch.ones_like(scores))
    total = zeros.index_add(0, group, scores)
    mean = total / count
    sq_dev = zeros.index_add(0, group, (scores - mean[group]) ** 2)
    var = sq_dev / (count - 1).clamp(min=1)
    return count[group], total[group], var[group]


def _check_group_inputs(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    check_ndim("scores", scores, 1, "[B]")
    check_ndim("response_mask", response_mask, 2, "[B, T]")
    check_floating(("scores", scores))
    if response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"`response_mask` has shape {tuple(response_mask.shape)} but `scores` has shape "
            f"{tuple(scores.shape)}; their first dimensions must match"
        )


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al., 2024): A_i = (s_i − mean_g) / (std_g + eps).

    mean_g and the unbiased std_g are over the samples sharing ``group_ids[i]`` (the
    responses to one prompt). A group of one uses mean 0 and std 1. ``norm_by_std=False``
    gives A_i = s_i − mean_g (Dr. GRPO). A_i is broadcast over the sequence's tokens.

    Args:
        scores: ``[B]`` sequence scores.
        group_ids: ``[B]`` integer tensor, or a length-B sequence of hashable ids (str, int).
        response_mask: ``[B, T]``.
        norm_by_std: divide by the group std.
        eps: added to the std.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and equal (A_i · m_t).
    """
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        count, total, var = _group_stats(scores, group)
        single = count == 1
        mean = torch.where(single, torch.zeros_like(total), total / count)
        std = torch.where(single, torch.ones_like(var), var.sqrt())
        adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
        token_adv = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return token_adv, token_adv


def compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al., 2024): A_i = s_i − mean of the others.

    A_i = s_i − (Σ_g − s_i) / (n_g − 1) for a group of n_g > 1; a group of one keeps s_i.

    Args:
        scores: ``[B]`` sequence scores.
        group_ids: ``[B]`` integer tensor, or a length-B sequence of hashable ids.
        response_mask: ``[B, T]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and equal (A_i · m_t).
    """
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        count, total, _ = _group_stats(scores, group)
        others_mean = (total - scores) / (count - 1).clamp(min=1)
        adv = torch.where(count > 1, scores - others_mean, scores)
        token_adv = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return token_adv, token_adv


def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    *,
    dp_sum: SumOverRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): whitened discounted return-to-go, no critic.

    G_t = r_t + γ·m_{t+1}·G_{t+1}: the running return is multiplied by the mask after
    each step, so it restarts at every masked position (as verl does). advantages =
    masked_whiten(G) · m.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (KL penalty already folded in).
        response_mask: ``[B, T]`` binary mask.
        gamma: discount γ.
        dp_sum: sums over data-parallel ranks: whiten over the whole batch.

    Returns:
        ``(advantages, returns)``: whitened, masked advantages and the raw returns G.
    """
    check_ndim("token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(("token_rewards", token_rewards), ("response_mask", response_mask))
    check_floating(("token_rewards", token_rewards))
    with torch.no_grad():
        rewards_tb = token_rewards.t().contiguous()
        mask_tb = response_mask.to(token_rewards.dtype).t().contiguous()
        returns_tb = torch.empty_like(rewards_tb)
        running = rewards_tb.new_zeros(rewards_tb.shape[1])
        for t in range(rewards_tb.shape[0] - 1, -1, -1):
            running = rewards_tb[t] + gamma * running
            returns_tb[t] = running
            running = running * mask_tb[t]
        returns = returns_tb.t()
        whitened = masked_whiten(returns, response_mask, dp_sum=dp_sum)
        advantages = whitened * response_mask.to(returns.dtype)
    return advantages, returns
