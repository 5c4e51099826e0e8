"""The names ppo_core's functions accept, without torch: a trainer checks its
configuration (``algorithm.kl_penalty``, ``actor.loss_agg_mode``) before torch loads."""

from __future__ import annotations

KL_BASE_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
"""Schulman's estimators and verl's names for them (``kl``=k1, ``mse``=k2, ``low_var_kl``=k3)."""

KL_ESTIMATORS: tuple[str, ...] = KL_BASE_ESTIMATORS + tuple(f"{n}+" for n in KL_BASE_ESTIMATORS)
"""Every name :func:`ppo_core.kl_penalty` accepts (``+``: the straight-through variant)."""

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Every ``mode`` :func:`ppo_core.aggregate_loss` accepts."""
