"""Loss aggregation, the clipped PPO policy loss (verl's ``vanilla``), the ratio-free
policy gradient and the value loss. The other policy losses: :mod:`ppo_core.policy_losses`.

Notation: ``ℓ`` a ``[B, T]`` per-token loss, ``m`` the response mask, a *valid sequence*
one with at least one valid token.

Gradient accumulation and data parallelism: pass ``global_num_tokens`` (or
``global_num_seqs``) = the total over all micro-batches and all DP ranks of one optimizer
step, and ``dp_size``. Each micro-batch loss is then its share of the exact global mean,
scaled by ``dp_size`` because DDP/FSDP average gradients over ranks; summing the
micro-batch losses of every rank and dividing by ``dp_size`` gives the global mean. A
per-micro-batch mean (what you get without the counts) weights short micro-batches too much.
"""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape, mask_as
from ppo_core.masked import masked_mean
from ppo_core.options import LOSS_AGG_MODES

SHARE_METRICS = ("pg_loss", "vf_loss")
"""Metrics of :func:`policy_loss` / :func:`value_loss` that are micro-batch *shares* of the
global loss (given the global counts): a step's value is their sum over micro-batches, not
a token-weighted mean like the other metrics."""

Count = int | float | torch.Tensor


def _as_count(value: Count, like: torch.Tensor) -> torch.Tensor:
    # An empty global batch would divide 0 by 0; its loss is 0 instead.
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1)


def _per_sequence_loss(
    loss_mat: torch.Tensor, m: torch.Tensor, mode: str, loss_scale_factor: float | None
) -> torch.Tensor:
    token_sum = (loss_mat * m).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return token_sum
    if mode == "seq-mean-token-mean":
        return token_sum / m.sum(dim=-1).clamp(min=1)
    scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if not scale > 0:
        raise ValueError(f"`loss_scale_factor` must be > 0, got {scale}")
    return token_sum / scale


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    Modes (N_tok = valid tokens, N_seq = valid sequences, L = ``loss_scale_factor``):

    - ``"token-mean"``: Σ ℓ·m / N_tok
    - ``"seq-mean-token-sum"``: mean over valid sequences of Σ_t ℓ·m
    - ``"seq-mean-token-mean"``: mean over valid sequences of (Σ_t ℓ·m / Σ_t m)
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): mean over valid sequences of Σ_t ℓ·m / L,
      L defaulting to the padded length T. (verl sums over sequences here, its issue
      #3741; we average, so the scale does not grow with the batch size.)

    An all-masked row neither contributes nor counts. With ``global_num_tokens``
    (token-mean) or ``global_num_seqs`` (seq modes) the local numerator is divided by the
    global count and multiplied by ``dp_size`` (see the module docstring); otherwise
    the local count is used.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        mask: ``[B, T]``.
        mode: one of :data:`LOSS_AGG_MODES`.
        global_num_tokens: valid tokens in the whole optimizer step, all ranks.
        global_num_seqs: valid sequences in the whole optimizer step, all ranks.
        dp_size: number of data-parallel ranks that average gradients.
        loss_scale_factor: L for ``"seq-mean-token-sum-norm"``.

    Returns:
        Scalar loss (differentiable).
    """
    check_ndim("loss_mat", loss_mat, 2, "[B, T]")
    check_same_shape(("loss_mat", loss_mat), ("mask", mask))
    if mode not in LOSS_AGG_MODES:
        valid = ", ".join(LOSS_AGG_MODES)
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {valid}")
    if dp_size < 1:
        raise ValueError(f"`dp_size` must be >= 1, got {dp_size}")
    m = mask_as(mask, loss_mat)
    if mode == "token-mean":
        if global_num_tokens is None:
            return masked_mean(loss_mat, mask)
        return (loss_mat * m).sum() / _as_count(global_num_tokens, loss_mat) * dp_size
    seq_valid = (m.sum(dim=-1) > 0).to(loss_mat.dtype)
    seq_total = (_per_sequence_loss(loss_mat, m, mode, loss_scale_factor) * seq_valid).sum()
    if global_num_seqs is None:
        return seq_total / seq_valid.sum().clamp(min=1)
    return seq_total / _as_count(global_num_seqs, loss_mat) * dp_size


def _check_loss_inputs(**tensors: torch.Tensor) -> None:
    (first_name, first), *_ = tensors.items()
    check_ndim(first_name, first, 2, "[B, T]")
    check_same_shape(*tensors.items())
    check_floating(*((n, t) for n, t in tensors.items() if n != "response_mask"))


def _weighted(
    per_token: torch.Tensor, is_weights: torch.Tensor | None, logprob: torch.Tensor
) -> torch.Tensor:
    """ℓ·w with rollout-correction weights (detached), or ℓ without them."""
    if is_weights is None:
        return per_token
    check_same_shape(("is_weights", is_weights), ("logprob", logprob))
    return per_token * is_weights.detach()


def clipped_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al., 2017) with dual-clip (Ye et al., 2020).

    ρ = exp(clamp(logprob − old_logprob, −20, 20)),
    ℓ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)); where A < 0, ℓ = min(ℓ, −A·c);
    with rollout-correction weights w, ℓ·w (verl's). The loss is
    ``aggregate_loss(ℓ, m, agg_mode, ...)``.

    Args:
        logprob: ``[B, T]`` log π_θ (with gradient).
        old_logprob: ``[B, T]`` log π_old of the rollout.
        advantages: ``[B, T]``.
        response_mask: ``[B, T]``.
        clip_ratio_low: ε_low.
        clip_ratio_high: ε_high (decoupled upper clip, "clip-higher").
        clip_ratio_c: dual-clip bound c > 1 for negative advantages; ``None`` disables it.
        agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor:
            see :func:`aggregate_loss`.
        is_weights: ``[B, T]`` detached importance weights π_old/π_rollout
            (:func:`ppo_core.rollout_is_weights`), or ``None``.

    Returns:
        ``(loss, metrics)``; metrics (detached, masked means over this micro-batch):
        ``pg_loss``, ``pg_clipfrac`` (share of tokens where the ratio clip is active),
        ``pg_clipfrac_lower`` (share where the dual clip is active), ``ppo_kl``
        (mean of old − new log-prob, the k1 estimate of KL(π_old ‖ π_θ)).
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"`clip_ratio_c` must be > 1 for dual-clip, got {clip_ratio_c}")
    log_ratio = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_active = negative & (per_token > bound)
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    per_token = _weighted(per_token, is_weights, logprob)
    loss = aggregate_loss(
        per_token,
        response_mask,
        agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean((clipped > unclipped).to(logprob.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(dual_active.to(logprob.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


def reinforce_loss(
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient without a ratio or clipping (verl's bypass-mode ``reinforce``):
    ℓ = −A·log π_θ·w per token (w = 1 without weights), aggregated as :func:`aggregate_loss`.

    Args:
        logprob: ``[B, T]`` log π_θ (with gradient).
        advantages, response_mask: ``[B, T]``.
        is_weights: ``[B, T]`` detached importance weights, or ``None``.

    Returns:
        ``(loss, {"pg_loss": loss})`` (detached metric).
    """
    _check_loss_inputs(logprob=logprob, advantages=advantages, response_mask=response_mask)
    per_token = -advantages * logprob
    per_token = _weighted(per_token, is_weights, logprob)
    loss = aggregate_loss(
        per_token,
        response_mask,
        agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, {"pg_loss": loss.detach()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float = 0.5,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ½ · agg(max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)).

    Args:
        values: ``[B, T]`` current critic values V (with gradient).
        old_values: ``[B, T]`` values V_old at rollout time.
        returns: ``[B, T]`` targets R.
        response_mask: ``[B, T]``.
        clip_range: ε.
        agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor:
            see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``; metrics (detached): ``vf_loss``, ``vf_clipfrac`` (share of
        tokens where the clipped term is the larger), ``vpred_mean`` (masked mean of V).
    """
    _check_loss_inputs(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    per_token = torch.maximum(unclipped_sq, clipped_sq)
    loss = 0.5 * aggregate_loss(
        per_token,
        response_mask,
        agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean(
            (clipped_sq > unclipped_sq).to(values.dtype), response_mask
        ).detach(),
        "vpred_mean": masked_mean(values, response_mask).detach(),
    }
    return loss, metrics
