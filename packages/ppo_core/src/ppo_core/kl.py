"""KL estimators between the policy and the reference, the KL reward penalty, and KL controllers.

Notation: per token, Δ = log π(a) − log π_ref(a) for a sampled from π (Schulman's
"Approximating KL divergence" estimators k1, k2, k3 of KL(π ‖ π_ref)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppo_core._checks import check_floating, check_ndim, check_same_shape, mask_as
from ppo_core.masked import masked_mean
from ppo_core.options import KL_BASE_ESTIMATORS, KL_ESTIMATORS


def _k1(delta: torch.Tensor) -> torch.Tensor:
    return delta


def _abs(delta: torch.Tensor) -> torch.Tensor:
    return delta.abs()


def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta.square()


def _k3(delta: torch.Tensor) -> torch.Tensor:
    # κ = log(π_ref/π); k3 = e^κ − κ − 1 ≥ 0. Both clamps bound the value when the
    # policy has drifted far (verl's "low_var_kl"). expm1(κ) − κ is the same value, but
    # exp(κ) − κ − 1 rounds to −1 ulp of 1 (−1e-16 in float64, −6e-8 in float32) for
    # small |κ|; expm1(κ) > κ holds in floating point too, so the result stays ≥ 0.
    kappa = torch.clamp(-delta, min=-20.0, max=20.0)
    return torch.clamp(torch.expm1(kappa) - kappa, min=-10.0, max=10.0)


_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}

if tuple(_ESTIMATORS) != KL_BASE_ESTIMATORS:  # the torch-free list must name these
    raise ImportError(f"ppo_core.options.KL_BASE_ESTIMATORS != {tuple(_ESTIMATORS)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    With Δ = logprob − ref_logprob:

    - ``"k1"`` / ``"kl"``: Δ
    - ``"abs"``: |Δ|
    - ``"k2"`` / ``"mse"``: ½Δ²
    - ``"k3"`` / ``"low_var_kl"``: clamp(e^κ − κ − 1, −10, 10) with κ = clamp(−Δ, −20, 20)
    - a trailing ``"+"`` (``"k3+"``, ``"k1+"``, ...): straight-through, the value of the
      named estimator with the gradient of k2: k2 − sg(k2) + sg(named), sg = stop-gradient.
      k2's gradient Δ·∇log π is an unbiased gradient of KL(π ‖ π_ref) when used as a loss.

    Args:
        logprob: ``[B, T]`` log π of the sampled tokens.
        ref_logprob: ``[B, T]`` log π_ref of the same tokens.
        estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` per-token estimates (not masked).
    """
    check_same_shape(("logprob", logprob), ("ref_logprob", ref_logprob))
    check_floating(("logprob", logprob), ("ref_logprob", ref_logprob))
    straight_through = estimator.endswith("+")
    name = estimator[:-1] if straight_through else estimator
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    delta = logprob - ref_logprob
    value = _ESTIMATORS[name](delta)
    if not straight_through:
        return value
    # k2 − sg(k2) + sg(value), written as sg(value) + sg(Δ)·(Δ − sg(Δ)): the same forward
    # value and the same gradient Δ·∇Δ, without inf − inf once ½Δ² overflows.
    return value.detach() + delta.detach() * (delta - delta.detach())


def apply_kl_penalty(
    token_scores: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Subtract the KL penalty from the per-token task scores (KL in the reward).

    r_t = s_t − β · KL_t · m_t, KL_t = ``kl_penalty(old_logprob, ref_logprob, estimator)``.

    Args:
        token_scores: ``[B, T]`` task reward per response token (usually the sequence
            score on the last valid token, 0 elsewhere).
        old_logprob: ``[B, T]`` log-probs of the rollout policy.
        ref_logprob: ``[B, T]`` log-probs of the reference policy.
        response_mask: ``[B, T]`` 1 on response tokens.
        kl_coef: β.
        estimator: see :func:`kl_penalty`.

    Returns:
        ``(token_rewards [B, T], metrics)``. ``metrics["kl"]`` is the batch mean of each
        sequence's masked token-mean KL (rows with no valid token count as 0, as in
        verl) — the quantity an adaptive controller consumes; ``metrics["kl_coef"]`` is β.
    """
    check_ndim("token_scores", token_scores, 2, "[B, T]")
    check_same_shape(
        ("token_scores", token_scores),
        ("old_logprob", old_logprob),
        ("ref_logprob", ref_logprob),
        ("response_mask", response_mask),
    )
    kld = kl_penalty(old_logprob, ref_logprob, estimator) * mask_as(response_mask, old_logprob)
    token_rewards = token_scores - kl_coef * kld
    seq_kl = masked_mean(kld, response_mask, dim=-1)
    metrics = {
        "kl": seq_kl.mean().detach(),
        "kl_coef": torch.as_tensor(kl_coef, dtype=token_rewards.dtype).detach().clone(),
    }
    return token_rewards, metrics
