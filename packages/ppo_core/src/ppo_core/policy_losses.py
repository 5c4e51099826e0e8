"""verl's other policy losses (``actor.policy_loss.loss_mode``, verl b178a3cd
``core_algos.py``), and :func:`policy_loss`, which dispatches to any of them by name.

Every loss takes ``(logprob, old_logprob, advantages, response_mask)``, all ``[B, T]``
(``logprob`` with gradient), its own hyperparameters under verl's names, and the
aggregation keywords of :func:`ppo_core.aggregate_loss` (``agg_mode``,
``global_num_tokens``, ``global_num_seqs``, ``dp_size``, ``loss_scale_factor``), so its
micro-batch loss is its exact share of the global one under accumulation and data
parallelism; ``is_weights`` (rollout correction, detached) multiply the per-token loss.
It returns ``(loss, metrics)``, the metrics detached masked means over the micro-batch.
ρ = π_θ/π_old = exp(log π_θ − log π_old) throughout; sg(·) is a stop-gradient.
The covariance-selected losses (``clip_cov``, ``kl_cov``): :mod:`ppo_core.cov_losses`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ppo_core._checks import mask_as
from ppo_core.cov_losses import clip_cov_loss, kl_cov_loss
from ppo_core.losses import (
    Count,
    _check_loss_inputs,
    _weighted,
    aggregate_loss,
    clipped_policy_loss,
    reinforce_loss,
)
from ppo_core.masked import masked_mean
from ppo_core.options import POLICY_LOSS_MODES, RejectionRule
from ppo_core.rollout_correction import normalize_is_weights, rejection_mask, rollout_is_weights

Metrics = dict[str, torch.Tensor]
BOUND = 20.0  # |log ρ| is clamped here before exp where verl clamps it (ρ stays finite)


def _ratio_metrics(log_ratio, mask, clipfrac, clipfrac_lower=None) -> Metrics:
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    return {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": zero if clipfrac_lower is None else clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }


def _finish(per_token, mask, agg_mode, counts: dict, metrics: Metrics):
    loss = aggregate_loss(per_token, mask, agg_mode, **counts)
    return loss, {"pg_loss": loss.detach(), **metrics}


def gspo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al., 2025, arXiv:2507.18071): one importance ratio per sequence.

    log s_b = Σ_t m·log ρ / |y_b| (the length-normalized sequence ratio);
    s_bt = exp(min(sg(log s_b) + log π_θ − sg(log π_θ), 10)), equal to s_b in value with the
    token's own gradient; ℓ = max(−A·s_bt, −A·clip(s_bt, 1 − ε_low, 1 + ε_high)).

    verl aggregates GSPO as ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says; that is
    this function's default, and a caller that wants verl's behaviour passes it whatever
    its configuration's mode (klppo's app does). Metrics: ``pg_loss``, ``pg_clipfrac``,
    ``pg_clipfrac_lower`` (0: GSPO has no dual clip), ``ppo_kl`` (token k1).
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    m = mask_as(response_mask, logprob)
    log_ratio = logprob - old_logprob
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = _weighted(torch.maximum(unclipped, clipped), is_weights, logprob)
    clipfrac = masked_mean((clipped > unclipped).to(logprob.dtype), response_mask)
    counts = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                  dp_size=dp_size, loss_scale_factor=loss_scale_factor)  # fmt: skip
    metrics = _ratio_metrics(log_ratio, response_mask, clipfrac)
    return _finish(per_token, response_mask, agg_mode, counts, metrics)


def sapo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (arXiv:2511.20347): a smooth gate on the ratio instead of a hard clip.

    ρ = exp(clamp(log ρ, ±20)), τ = τ_pos where A > 0 else τ_neg,
    f(ρ) = σ(τ·(ρ − 1))·4/τ (slope 1 at ρ = 1, flat far from it), ℓ = −f(ρ)·A.

    Aggregated ``seq-mean-token-mean`` by default, as verl forces (see :func:`gspo_loss`).
    Metrics: ``pg_loss``, ``pg_clipfrac`` and ``pg_clipfrac_lower`` (0: nothing is clipped),
    ``ppo_kl``.
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    log_ratio = (logprob - old_logprob).clamp(-BOUND, BOUND)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    per_token = _weighted(-gate * advantages, is_weights, logprob)
    zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
    counts = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                  dp_size=dp_size, loss_scale_factor=loss_scale_factor)  # fmt: skip
    metrics = _ratio_metrics(log_ratio, response_mask, zero)
    return _finish(per_token, response_mask, agg_mode, counts, metrics)


def geo_mean_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al., 2025, arXiv:2507.20673): the geometric mean of clipped token ratios.

    Per token, log ρ is clipped in log space on the side the advantage pushes:
    c = sgn(A)·min(sgn(A)·log ρ, sgn(A)·clamp(log ρ, −ε_low, ε_high)); per sequence,
    r_b = exp(Σ_t m·c / |y_b|), Ā_b = Σ_t m·A / |y_b| (a sequence-level advantage),
    ℓ_b = −Ā_b·r_b, times the weights' geometric mean exp(Σ m·log(w + 1e-10) / |y_b|) with
    ``is_weights``. The loss is the mean of ℓ_b over sequences (``global_num_seqs`` and
    ``dp_size`` as :func:`aggregate_loss`); ``agg_mode`` and ``loss_scale_factor`` are
    accepted and unused, as in verl. verl's mean also counts a row with no valid token
    (as 0); this one does not (the two agree when every row has a token).
    Metrics: ``pg_loss``, ``pg_clipfrac`` / ``pg_clipfrac_lower`` (share of tokens whose
    log ρ was clamped, with A > 0 / A < 0), ``ppo_kl``.
    """
    del agg_mode, global_num_tokens, loss_scale_factor  # one aggregation: over sequences
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    m = mask_as(response_mask, logprob)
    log_ratio = logprob - old_logprob  # verl does not clamp it here
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    c = sign * torch.minimum(sign * log_ratio, sign * bounded)
    length = m.sum(-1).clamp(min=1)
    per_seq = -(advantages * m).sum(-1) / length * torch.exp((c * m).sum(-1) / length)
    if is_weights is not None:
        log_w = torch.log(is_weights.detach() + 1e-10)
        per_seq = per_seq * torch.exp((log_w * m).sum(-1) / length)
    valid = (m.sum(-1) > 0).to(logprob.dtype)
    loss = aggregate_loss(
        per_seq[:, None], valid[:, None], "seq-mean-token-sum",
        global_num_seqs=global_num_seqs, dp_size=dp_size,
    )  # fmt: skip
    moved = (log_ratio != bounded).to(logprob.dtype)
    metrics = _ratio_metrics(
        log_ratio,
        response_mask,
        masked_mean(moved * (advantages > 0), response_mask),
        masked_mean(moved * (advantages < 0), response_mask),
    )
    return loss, {"pg_loss": loss.detach(), **metrics}


def cispo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    ρ = exp(clamp(log ρ, ±20)), ℓ = −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·log π_θ: every
    token keeps a gradient (∂ℓ/∂log π_θ = −sg(clip(ρ))·A), the clipped ones too.
    Metrics: ``pg_loss``, ``pg_clipfrac`` (share where clip(ρ) ≠ ρ), ``pg_clipfrac_lower``
    (0), ``ppo_kl``.
    """
    _check_loss_inputs(
        logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask
    )
    log_ratio = (logprob - old_logprob).clamp(-BOUND, BOUND)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    per_token = _weighted(-weight * advantages * logprob, is_weights, logprob)
    clipfrac = masked_mean((ratio != weight).to(logprob.dtype), response_mask)
    counts = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                  dp_size=dp_size, loss_scale_factor=loss_scale_factor)  # fmt: skip
    return _finish(per_token, response_mask, agg_mode, counts,
                   _ratio_metrics(log_ratio, response_mask, clipfrac))  # fmt: skip


def gpg_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **aggregation,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al., 2025, arXiv:2504.02546): ℓ = −A·log π_θ, no ratio and no clip;
    ``old_logprob`` is unused. :func:`ppo_core.reinforce_loss` with verl's loss-mode
    signature (``**aggregation``: its keywords)."""
    del old_logprob
    return reinforce_loss(logprob, advantages, response_mask, **aggregation)


def bypass_mode_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Sequence[RejectionRule] = (),
    **kwargs,
) -> tuple[torch.Tensor, Metrics]:
    """verl's bypass mode: ``old_logprob`` *is* the engine's π_rollout (no old-log-prob pass).

    Weights w = TIS(sg(π_θ)/π_rollout) at ``rollout_is`` (``"token"``, ``"sequence"`` or
    ``None``), normalized over this micro-batch with ``rollout_is_batch_normalize``, and
    the mask with ``rollout_rs`` (:func:`ppo_core.rejection_rules`) applied. ``loss_type``
    ``"ppo_clip"``: :func:`clipped_policy_loss` of ρ = π_θ/π_rollout over the kept tokens,
    the weights only measured (the clip bounds that ratio already; applying w would count
    it twice); ``"reinforce"``: :func:`ppo_core.reinforce_loss` −A·log π_θ·w over them.
    ``kwargs``: the chosen loss's keywords. Metrics: the loss's and the weights'/rejection's.
    """
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"`loss_type` must be 'ppo_clip' or 'reinforce', got {loss_type!r}")
    current = logprob.detach()
    weights, metrics = None, {}
    if rollout_is is not None:
        weights, metrics = rollout_is_weights(
            current, old_logprob, response_mask, level=rollout_is, threshold=rollout_is_threshold
        )
        if rollout_is_batch_normalize:
            weights, more = normalize_is_weights(weights, response_mask, level=rollout_is)
            metrics.update(more)
    mask = response_mask
    if rollout_rs:
        mask, more = rejection_mask(current, old_logprob, response_mask, rollout_rs)
        metrics.update(more)
    if loss_type == "reinforce":
        loss, more = reinforce_loss(logprob, advantages, mask, is_weights=weights, **kwargs)
    else:
        loss, more = clipped_policy_loss(logprob, old_logprob, advantages, mask, **kwargs)
    return loss, {**metrics, **more}


PolicyLossFn = Callable[..., tuple[torch.Tensor, Metrics]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": clipped_policy_loss,
    "gspo": gspo_loss,
    "sapo": sapo_loss,
    "gpg": gpg_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
    "geo_mean": geo_mean_loss,
    "cispo": cispo_loss,
    "bypass_mode": bypass_mode_loss,
}
"""verl's registered policy losses by their ``loss_mode`` names (:data:`POLICY_LOSS_MODES`)."""
assert tuple(POLICY_LOSSES) == POLICY_LOSS_MODES


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    **hyperparameters,
) -> tuple[torch.Tensor, Metrics]:
    """The policy loss named ``loss_mode`` (verl's ``actor.policy_loss.loss_mode``):
    ``POLICY_LOSSES[loss_mode](logprob, old_logprob, advantages, response_mask,
    **hyperparameters)``. The default, ``"vanilla"``, is :func:`clipped_policy_loss` (PPO's
    clipped surrogate with dual-clip). All tensors ``[B, T]``; a keyword the mode does not
    take raises ``TypeError``.

    Example::

        loss, metrics = policy_loss(logp, old_logp, adv, mask, loss_mode="gspo",
                                    clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    """
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(f"unknown loss_mode {loss_mode!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[loss_mode](
        logprob, old_logprob, advantages, response_mask, **hyperparameters
    )
