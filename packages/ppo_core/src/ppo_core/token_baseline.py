"""The optimal token baseline (verl's ``optimal_token_baseline`` and, for responses with
tool/observation tokens inside, ``tir_optimal_token_baseline``): a baseline per position,
B_t = Σ_i G_it·W_it / Σ_i W_it over the responses i to one prompt, where G_t is the
reward-to-go and W_t = Σ_{j ≤ t} (1 − 2π_j + Σ_v π_v²) the path's accumulated variance
proxy (‖∇ log π‖² of a softmax's logits: 1 − 2π_j + Σπ²), scaled by ρ̄² under truncated
importance weights. Responses with more variance so far weigh more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape
from ppo_core.advantages import _group_index


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: row b's values at its valid tokens, moved to the front (L = the longest
    row's count), zeros after."""
    rank = mask.long().cumsum(-1) - 1
    out = x.new_zeros(x.shape[0], int(mask.sum(-1).max()) if x.numel() else 0)
    rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(rank)
    return out.index_put_((rows[mask], rank[mask]), x[mask])


def _group_baselines(returns, weights, valid, group, handle_zero_tail, eps, skip_empty):
    baselines = torch.zeros_like(returns)
    lengths = valid.sum(-1)
    for g in range(int(group.max()) + 1 if group.numel() else 0):
        members = torch.nonzero((group == g) & ((lengths > 0) | (not skip_empty))).squeeze(-1)
        if members.numel() < 2:
            continue  # a lone response keeps its return as advantage
        w = weights[members] * valid[members]
        b = (returns[members] * w).sum(0) / (w.sum(0) + eps)
        baselines[members] = b.to(baselines.dtype)
        if handle_zero_tail:  # past the second-longest response, a lone baseline is its own G
            ordered = torch.sort(lengths[members]).values
            longest = torch.nonzero(lengths[members] == ordered[-1]).squeeze(-1)
            if longest.numel() == 1 and ordered[-1] > ordered[-2]:
                baselines[members[longest[0]], int(ordered[-2]) :] = 0.0
    return baselines


def compute_optimal_token_baseline_advantages(
    token_rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    old_logprob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    *,
    by_token_count: bool = False,
    handle_zero_tail: bool = False,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages A_t = (G_t − B_t)·m_t with the optimal token baseline B_t (module docstring).

    G_t = Σ_{t' ≥ t} r_t'·m_t'. ``by_token_count=False`` (verl's ``optimal_token_baseline``)
    lines the responses of a group up by position t; ``True`` (``tir_...``, whose default
    ``handle_zero_tail`` is True) by the count of valid tokens, so that observation tokens
    inside a response do not shift the alignment (the two agree on responses without holes),
    and an empty response is left out of its group (as verl's).
    ``handle_zero_tail``: where one response is longer than all others in its group, its
    baseline past the second-longest is 0.

    Args:
        token_rewards, response_mask: ``[B, T]``.
        group_ids: ``[B]``.
        old_logprob: ``[B, T]`` log π_old of the sampled tokens.
        sum_pi_squared: ``[B, T]`` Σ_v π_old(v)² at each position.
        is_weights: ``[B, T]`` truncated importance weights ρ̄, or ``None``.

    Returns:
        ``(advantages, returns)``, ``[B, T]``.
    """
    check_ndim("token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(("token_rewards", token_rewards), ("response_mask", response_mask),
                     ("old_logprob", old_logprob), ("sum_pi_squared", sum_pi_squared))  # fmt: skip
    check_floating(("token_rewards", token_rewards), ("old_logprob", old_logprob))
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        group = _group_index(group_ids, token_rewards.shape[0], token_rewards.device)
        returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
        w = 1.0 - 2.0 * torch.exp(old_logprob) + sum_pi_squared
        if is_weights is not None:
            w = w * is_weights**2
        cumulative = (w * m).cumsum(-1)
        if not by_token_count:
            baselines = _group_baselines(
                returns, cumulative, m, group, handle_zero_tail, eps, False
            )
            return (returns - baselines) * m, returns
        valid = response_mask.bool()
        g_c, w_c = _compact(returns, valid), _compact(cumulative, valid)
        v_c = _compact(m, valid)
        baselines = _group_baselines(g_c, w_c, v_c, group, handle_zero_tail, eps, True)
        advantages = torch.zeros_like(returns)
        advantages[valid] = (g_c - baselines)[v_c.bool()]
    return advantages, returns
