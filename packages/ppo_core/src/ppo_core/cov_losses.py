"""Clip-Cov and KL-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning
for Reasoning Language Models", arXiv:2505.22617; verl's ``clip_cov`` and ``kl_cov``).

Entropy collapses through the few tokens whose log-prob and advantage covary most; these
losses pick those tokens by the centred product
cov_t = (A_t − Ā)·(log π_θ,t − mean log π_θ) (means over the micro-batch's valid tokens)
and either drop their gradient (Clip-Cov) or add a KL penalty on them (KL-Cov).
The number of tokens picked, max(1, ⌊ratio · N⌋), is a host-side integer (one sync, as
in verl); the selection itself is not differentiated.
"""

from __future__ import annotations

import torch

from ppo_core._checks import mask_as
from ppo_core.losses import Count, _check_loss_inputs, _weighted, aggregate_loss
from ppo_core.masked import masked_mean

Metrics = dict[str, torch.Tensor]


def _centred_cov(advantages, logprob, m) -> torch.Tensor:
    return (advantages - masked_mean(advantages, m)) * (
        logprob.detach() - masked_mean(logprob.detach(), m)
    )


def _num_picked(ratio: float, m: torch.Tensor) -> int:
    return max(int(ratio * int(m.sum().item())), 1)


def clip_cov_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens cut.

    ρ = exp(log ρ) (not clamped, as verl), ℓ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)).
    Candidates: valid tokens the ratio clip left alone with ``clip_cov_lb`` < cov_t <
    ``clip_cov_ub``; k = max(1, ⌊``clip_cov_ratio``·N⌋) of them (N valid tokens) are drawn
    uniformly at random (``torch.randperm``, from ``generator`` or the global generator as
    verl does) and their ℓ is set to 0.

    Metrics: ``pg_loss``, ``pg_clipfrac`` (share of valid tokens cut), ``ppo_kl``.
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    if not clip_cov_ratio > 0:
        raise ValueError(f"`clip_cov_ratio` must be > 0, got {clip_cov_ratio}")
    m = mask_as(response_mask, logprob)
    log_ratio = logprob - old_logprob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    cov = _centred_cov(advantages, logprob, m)
    candidate = (m > 0) & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    where = torch.nonzero(candidate)
    order = torch.randperm(len(where), generator=generator)  # on the CPU, as verl draws
    picked = where[order[: _num_picked(clip_cov_ratio, m)].to(where.device)]
    keep = torch.ones_like(logprob)
    keep[picked[:, 0], picked[:, 1]] = 0.0
    per_token = _weighted(torch.maximum(unclipped, clipped) * keep, is_weights, logprob)
    loss = aggregate_loss(
        per_token, response_mask, agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, dp_size=dp_size, loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    return loss, {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean((keep == 0).to(logprob.dtype), response_mask),
        "ppo_kl": masked_mean(-log_ratio.detach(), response_mask),
    }


def kl_cov_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: the unclipped policy gradient, plus a KL penalty on the top-covariance tokens.

    ℓ = −A·ρ (ρ not clamped, no clip); on the k = max(1, ⌊``kl_cov_ratio``·N⌋) valid tokens
    of largest cov_t, ℓ = −A·ρ + ``ppo_kl_coef``·|log ρ|. ``ppo_kl_coef`` defaults to verl's
    configuration default, 0.1 (its function's fallback is 1.0).

    Metrics: ``pg_loss``, ``ppo_kl`` = masked mean of |log ρ| (verl reports the absolute
    value under this name for KL-Cov).
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    if not kl_cov_ratio > 0:
        raise ValueError(f"`kl_cov_ratio` must be > 0, got {kl_cov_ratio}")
    m = mask_as(response_mask, logprob)
    log_ratio = logprob - old_logprob
    per_token = -advantages * torch.exp(log_ratio)
    valid = m.reshape(-1) > 0
    if bool(valid.any()):
        cov = _centred_cov(advantages, logprob, m).reshape(-1)
        # only valid tokens compete (verl centres and ranks them alone; the centring
        # above uses the same valid-token means)
        cov = torch.where(valid, cov, torch.full_like(cov, -torch.inf))
        top = torch.topk(cov, _num_picked(kl_cov_ratio, m)).indices
        penalty = torch.zeros_like(per_token).reshape(-1)
        penalty[top] = 1.0
        per_token = per_token + ppo_kl_coef * log_ratio.abs() * penalty.view_as(per_token)
    per_token = _weighted(per_token, is_weights, logprob)
    loss = aggregate_loss(
        per_token, response_mask, agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, dp_size=dp_size, loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    return loss, {
        "pg_loss": loss.detach(),
        "ppo_kl": masked_mean(log_ratio.detach().abs(), response_mask),
    }
