"""Rollout correction: the engine samples from π_rollout, the trainer computes π_old; these
weigh or reject tokens by how far apart they are (Yao et al., 2025; verl's
``rollout_corr_helper``, whose definitions these follow exactly).

Notation: ``lr = log π_old − log π_rollout`` per token ``[B, T]`` (π_old: the trainer's
probability of the sampled token, π_rollout: the engine's), ``m`` the response mask,
``S_b = Σ_t m·lr`` a sequence's log-ratio, ``clamp₂₀`` a clamp to [−20, 20] (exp stays finite).

- :func:`rollout_is_weights`: importance weights, per token ``w = exp(clamp₂₀(lr))`` or per
  sequence ``w_b = exp(clamp₂₀(S_b))`` (the product of its token ratios), truncated above at
  ``threshold`` (TIS), detached.
- :func:`normalize_is_weights`: the weights divided by their batch mean.
- :func:`rejection_mask`: the response mask with tokens or sequences whose divergence is out of
  bounds set to 0 (:class:`~ppo_core.options.RejectionRule`; IcePop-style masking is
  ``token_k1`` with bounds on ``k1 = −lr``: the ratio window kept is
  ``[1/upper, 1/lower]``, verl's convention).
- :func:`off_policy_metrics`: how far apart the two policies are (KL, χ²).

Metrics are detached scalar tensors named as verl's (without its ``rollout_corr/`` prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape, mask_as
from ppo_core.masked import SumOverRanks, masked_mean, masked_sum
from ppo_core.options import IS_LEVELS, RejectionRule

BOUND = 20.0
Metrics = dict[str, torch.Tensor]


def _checked_log_ratio(
    old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    check_ndim("old_logprob", old_logprob, 2, "[B, T]")
    check_same_shape(
        ("old_logprob", old_logprob),
        ("rollout_logprob", rollout_logprob),
        ("response_mask", response_mask),
    )
    check_floating(("old_logprob", old_logprob), ("rollout_logprob", rollout_logprob))
    return (old_logprob - rollout_logprob).detach()


def rollout_is_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance weights π_old/π_rollout (TIS).

    token: ``w = exp(clamp₂₀(lr))``; sequence: ``w = exp(clamp₂₀(S_b))`` on every token of
    row b. Then ``w·m`` (0 at padding), metrics on these, ``min(w, threshold)``, detached.

    Args:
        old_logprob, rollout_logprob: ``[B, T]`` log-probs of the sampled tokens.
        response_mask: ``[B, T]``.
        level: ``"token"`` or ``"sequence"``.
        threshold: the truncation C > 0 (1/C only bounds the metrics' clamped weights).

    Returns:
        ``(weights [B, T], metrics)``, the metrics of the untruncated weights:
        ``rollout_is_mean``, ``_max``, ``_min``, ``rollout_is_ratio_fraction_high``/``_low``
        (share above C / below 1/C: tokens, or rows for ``sequence``), ``rollout_is_std`` and
        ``rollout_is_eff_sample_size`` = (Σw′)² / (N·Σw′²) of w′ = clamp(w, 1/C, C) over the N
        valid tokens (1: all equal).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"`level` must be one of {IS_LEVELS}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"`threshold` must be > 0, got {threshold}")
    lr = _checked_log_ratio(old_logprob, rollout_logprob, response_mask)
    m = mask_as(response_mask, lr)
    if level == "token":
        weights = torch.exp(lr.clamp(-BOUND, BOUND)) * m
        metrics = _token_extremes(weights, m, threshold)
    else:
        seq = masked_sum(lr, m, dim=-1)
        weights = torch.exp(seq.clamp(-BOUND, BOUND))[:, None] * m
        metrics = _sequence_extremes(weights, seq, m, threshold)
    metrics.update(_spread(weights, m, threshold))
    metrics["rollout_is_mean"] = masked_mean(weights, m)
    return weights.clamp(max=threshold), metrics


def _token_extremes(w: torch.Tensor, m: torch.Tensor, c: float) -> Metrics:
    valid = m.bool()
    return {
        "rollout_is_max": w.masked_fill(~valid, float("-inf")).max(),
        "rollout_is_min": w.masked_fill(~valid, float("inf")).min(),
        "rollout_is_ratio_fraction_high": masked_mean((w > c).to(w.dtype), m),
        "rollout_is_ratio_fraction_low": masked_mean((w < 1.0 / c).to(w.dtype), m),
    }


def _sequence_extremes(w: torch.Tensor, seq: torch.Tensor, m: torch.Tensor, c: float) -> Metrics:
    # verl's: over every row's S_b in log space (padding rows included), so no overflow
    log_c = torch.log(torch.tensor(c, dtype=seq.dtype, device=seq.device))
    return {
        "rollout_is_max": torch.exp(seq.max().clamp(max=BOUND)),
        "rollout_is_min": torch.exp(seq.min()),
        "rollout_is_ratio_fraction_high": (seq > log_c).to(w.dtype).mean(),
        "rollout_is_ratio_fraction_low": (seq < -log_c).to(w.dtype).mean(),
    }


def _spread(w: torch.Tensor, m: torch.Tensor, c: float) -> Metrics:
    clamped = w.clamp(min=1.0 / c, max=c)
    mean = masked_mean(clamped, m)
    var = (masked_mean(clamped.square(), m) - mean.square()).clamp(min=0)
    std = torch.where(m.sum() > 1, var.sqrt(), torch.zeros_like(var))
    ess = 1.0 / masked_mean((clamped / (mean + 1e-8)).square(), m)
    return {"rollout_is_std": std, "rollout_is_eff_sample_size": ess}


def normalize_is_weights(
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    dp_sum: SumOverRanks | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``w / μ`` (verl's ``rollout_is_batch_normalize``): μ the mean weight over valid tokens
    (``token``) or over the per-row mean weights of non-empty rows (``sequence``), over every
    rank's rows with ``dp_sum``; unchanged when μ ≤ 1e-8. The result may exceed the
    truncation threshold.

    Returns:
        ``(weights / μ, {"rollout_is_batch_norm_factor": μ})``.
    """
    m = mask_as(response_mask, weights)
    if level == "token":
        total, count = masked_sum(weights, m), m.sum()
    else:
        rows = m.sum(-1) > 0
        total = (masked_mean(weights, m, dim=-1) * rows).sum()
        count = rows.to(weights.dtype).sum()
    if dp_sum is not None:
        total, count = dp_sum(total.clone()), dp_sum(count.clone())
    mean = total / count.clamp(min=1)
    ok = mean > 1e-8
    factor = torch.where(ok, mean, torch.ones_like(mean))
    return weights / factor, {"rollout_is_batch_norm_factor": factor}


def _divergence(lr: torch.Tensor, kind: str) -> torch.Tensor:
    lr = lr.clamp(-BOUND, BOUND)
    if kind == "k1":
        return -lr  # log π_rollout/π_old
    if kind == "k2":
        return 0.5 * lr.square()
    return torch.exp(lr) - 1 - lr  # k3


def _statistic(lr: torch.Tensor, m: torch.Tensor, option: str) -> torch.Tensor:
    """The option's statistic on every token ``[B, T]`` (a sequence's on each of its tokens)."""
    where, kind = option.rsplit("_", 1)
    stat = _divergence(lr, kind)
    if where == "token":
        return stat
    if where == "seq_sum":
        seq = masked_sum(stat, m, dim=-1)
    elif where == "seq_mean":
        seq = masked_mean(stat, m, dim=-1)
    else:  # seq_max over valid tokens; a row without any: 0
        seq = stat.masked_fill(~m.bool(), float("-inf")).max(dim=-1).values
        seq = torch.where(torch.isinf(seq), torch.zeros_like(seq), seq)
    return seq[:, None].expand_as(stat)


def rejection_mask(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    rules: Sequence[RejectionRule],
) -> tuple[torch.Tensor, Metrics]:
    """The response mask with rejected tokens set to 0 (verl's ``rollout_rs``): a token is
    kept when every rule keeps it (a ``seq_*`` rule keeps or rejects its whole row).
    Statistics of ``lrs = clamp₂₀(lr)``: ``k1 = −lrs``, ``k2 = lrs²/2``,
    ``k3 = exp(lrs) − 1 − lrs``; per token, or a row's masked sum, mean or max. Kept:
    ``log(lower) ≤ k1 ≤ log(upper)``; ``k2, k3 ≤ upper``.

    Returns:
        ``(mask [B, T] in response_mask's dtype, metrics)``: per rule
        ``rollout_rs_<option>_mean`` (masked mean of the statistic) and ``_masked_fraction``
        (share of valid tokens it rejects); ``rollout_rs_masked_fraction`` (all rules) and
        ``rollout_rs_seq_masked_fraction`` (share of rows with a rejected token).
    """
    lr = _checked_log_ratio(old_logprob, rollout_logprob, response_mask)
    m = mask_as(response_mask, lr)
    keep = torch.ones_like(m)
    metrics: Metrics = {}
    for rule in rules:
        stat = _statistic(lr, m, rule.option)
        if rule.lower is None:
            kept = stat <= rule.upper
        else:
            kept = (stat >= torch.log(torch.tensor(rule.lower, dtype=lr.dtype))) & (
                stat <= torch.log(torch.tensor(rule.upper, dtype=lr.dtype))
            )
        kept = kept.to(m.dtype)
        keep = keep * kept
        metrics[f"rollout_rs_{rule.option}_mean"] = masked_mean(stat, m)
        metrics[f"rollout_rs_{rule.option}_masked_fraction"] = masked_mean(1 - kept, m)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep, m)
    rejected_rows = ((1 - keep) * m).sum(-1) > 0
    metrics["rollout_rs_seq_masked_fraction"] = rejected_rows.to(m.dtype).mean()
    return (response_mask * keep.to(response_mask.dtype)), metrics


def off_policy_metrics(
    old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor
) -> Metrics:
    """How far π_rollout is from π_old: ``kl`` = mean(log π_rollout − log π_old) (k1 of
    KL(π_rollout ‖ π_old), may be negative), ``k3_kl`` = mean(exp(lr) − lr − 1),
    ``chi2_token`` = mean(ρ²) − 1 with ρ = exp(clamp₂₀(lr)), ``chi2_seq`` = the rows' mean of
    exp(2·clamp₂₀(S_b)) − 1; means over valid tokens unless said."""
    lr = _checked_log_ratio(old_logprob, rollout_logprob, response_mask)
    m = mask_as(response_mask, lr)
    seq = masked_sum(lr, m, dim=-1).clamp(-BOUND, BOUND)
    return {
        "kl": masked_mean(-lr, m),
        "k3_kl": masked_mean(torch.exp(lr) - lr - 1, m),
        "chi2_token": masked_mean(torch.exp(lr.clamp(-BOUND, BOUND)).square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0,
    }
