"""verl's other outcome advantage estimators (``algorithm.adv_estimator``, verl b178a3cd
``core_algos.py``): Pass@k GRPO, REINFORCE++ with a group baseline, OPO, GPG and ReMax.
The optimal token baseline: :mod:`ppo_core.token_baseline`; every name:
:data:`ppo_core.ADVANTAGE_ESTIMATORS`.

Notation as :mod:`ppo_core.advantages`: ``scores`` ``[B]`` (a response's summed reward),
``group_ids`` ``[B]`` (the responses to one prompt share an id), ``m`` the ``[B, T]``
response mask. Each returns ``(advantages, returns)``, both ``[B, T]``, without gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape
from ppo_core.advantages import _check_group_inputs, _group_index, _group_stats
from ppo_core.masked import SumOverRanks, masked_whiten


def _group_mean(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean; 0 for a group of one (verl's)."""
    count, total, _ = _group_stats(scores, group)
    return torch.where(count > 1, total / count, torch.zeros_like(total))


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def compute_grpo_passk_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al., 2025, arXiv:2503.19595): only each group's best response is
    credited, with A = (s_max − s_second) / (std_g + eps) (``norm_by_std``; unbiased std);
    every other response gets 0. A group needs ≥ 2 responses (``ValueError`` otherwise, as
    verl). Ties for the best go to the one ``torch.topk`` returns first, as verl."""
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        adv = torch.zeros_like(scores)
        for g in range(int(group.max()) + 1 if group.numel() else 0):
            members = torch.nonzero(group == g).squeeze(-1)
            if members.numel() < 2:
                raise ValueError(
                    f"grpo_passk needs >= 2 responses per group; a group has {members.numel()}"
                )
            top, where = torch.topk(scores[members], 2)
            gap = top[0] - top[1]
            adv[members[where[0]]] = gap / (scores[members].std() + eps) if norm_by_std else gap
    return _broadcast(adv, response_mask), _broadcast(adv, response_mask)


def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    *,
    dp_sum: SumOverRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262): the group mean subtracted
    (0 for a group of one), broadcast over the tokens, then ``masked_whiten``-ed over the
    batch (every rank's with ``dp_sum``) and masked."""
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        centred = _broadcast(scores - _group_mean(scores, group), response_mask)
        adv = masked_whiten(centred, response_mask, dp_sum=dp_sum) * response_mask.to(scores.dtype)
    return adv, adv


def compute_opo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., 2025, arXiv:2505.23585): the optimal baseline of an exact on-policy
    gradient, the length-weighted group mean b_g = Σ|y_i|·s_i / Σ|y_i| (0 for a group of
    one); A_i = s_i − b_g, broadcast over the tokens."""
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        length = response_mask.to(scores.dtype).sum(-1)
        count, _, _ = _group_stats(scores, group)
        zeros = scores.new_zeros(count.numel() if group.numel() == 0 else int(group.max()) + 1)
        weighted = zeros.index_add(0, group, length * scores)[group]
        total_length = zeros.index_add(0, group, length)[group]
        baseline = torch.where(count > 1, weighted / total_length, torch.zeros_like(scores))
        adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


def compute_gpg_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    f_norm: float = 1.0,
    *,
    dp_sum: SumOverRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., 2025, arXiv:2504.02546): A_i = α·(s_i − mean_g)/``f_norm`` with
    α = B / #{i: s_i ≠ 0}, which corrects the gradient's scale for the responses that score 0
    (B and the count over every rank with ``dp_sum``; verl computes α from the batch and
    ignores its ``alpha`` argument). A group of one uses mean 0."""
    _check_group_inputs(scores, response_mask)
    with torch.no_grad():
        group = _group_index(group_ids, scores.shape[0], scores.device)
        counts = torch.stack([scores.new_tensor(float(scores.numel())),
                              torch.count_nonzero(scores).to(scores.dtype)])  # fmt: skip
        if dp_sum is not None:
            counts = dp_sum(counts)
        alpha = counts[0] / counts[1].clamp(min=1)
        adv = _broadcast(alpha * (scores - _group_mean(scores, group)) / f_norm, response_mask)
    return adv, adv


def compute_remax_advantages(
    token_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023, arXiv:2310.10505): the reward of the greedy response to the
    same prompt as the baseline. G_t = Σ_{t' ≥ t} r_t'·m_t' (no discount), A_t = G_t − b·m_t.

    Args:
        token_rewards: ``[B, T]``.
        reward_baselines: ``[B]`` the greedy response's score for each sample's prompt.
        response_mask: ``[B, T]``.

    Returns:
        ``(advantages, returns)``.
    """
    check_ndim("token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(("token_rewards", token_rewards), ("response_mask", response_mask))
    check_floating(("token_rewards", token_rewards), ("reward_baselines", reward_baselines))
    check_ndim("reward_baselines", reward_baselines, 1, "[B]")
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.unsqueeze(-1) * m
    return advantages, returns
