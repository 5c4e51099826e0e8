"""Rollout correction in the step (verl's ``algorithm.rollout_correction``), built once from
the config into :class:`RolloutCorrection`; the math is ``ppo_core``'s.

Decoupled (``bypass_mode=false``): after the forward passes, π_old (the old-log-prob pass,
which then always runs) against the engine's π_rollout gives the importance weights
(``Trajectories.is_weights``, applied per token in the policy loss) and the rejection mask,
which is the updates' loss mask: rejected tokens leave the actor's and the critic's
losses and their token counts. Rewards and advantages are computed over whole responses
(a rejected last token keeps its reward; verl's GRPO does the same, its GAE skips rejected
tokens in the recursion). Bypass (``bypass_mode=true``): π_old = π_rollout
(no old-log-prob pass); the policy loss computes weights and rejection per micro-batch from
sg(π_θ) against π_rollout (:meth:`RolloutCorrection.in_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from klppo_train.config.schema import RolloutCorrectionConfig
from klppo_train.runtime.process_group import dp_size, sum_over_ranks
from klppo_train.workers.trajectories import Trajectories
from ppo_core import (
    RejectionRule,
    normalize_is_weights,
    off_policy_metrics,
    rejection_mask,
    rejection_rules,
    rollout_is_weights,
)

PREFIX = "rollout_corr/"
Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RolloutCorrection:
    """What ``algorithm.rollout_correction`` asks for, read once: ``level`` of the weights
    (None: no weights), their truncation and batch normalization, the rejection rules, the
    mode and bypass_mode's loss."""

    level: str | None
    threshold: float
    batch_normalize: bool
    rules: tuple[RejectionRule, ...]
    bypass: bool
    loss_type: str

    @classmethod
    def of(cls, rc: RolloutCorrectionConfig) -> RolloutCorrection | None:
        """None when nothing is asked for (neither weights, nor rejection, nor bypass)."""
        if not rc.enabled and not rc.bypass_mode:
            return None
        rules = rejection_rules(rc.rollout_rs, rc.rollout_rs_threshold) if rc.rollout_rs else ()
        return cls(
            level=rc.rollout_is,
            threshold=rc.rollout_is_threshold,
            batch_normalize=rc.rollout_is_batch_normalize,
            rules=rules,
            bypass=rc.bypass_mode,
            loss_type=rc.loss_type,
        )

    def weights_and_mask(
        self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, dp_sum=None
    ) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
        """``(weights or None, the mask after rejection, metrics)`` of π_old vs π_rollout;
        batch normalization over the rows given (and over ranks with ``dp_sum``)."""
        metrics = off_policy_metrics(old, rollout, mask)
        weights = None
        if self.level is not None:
            weights, m = rollout_is_weights(
                old, rollout, mask, level=self.level, threshold=self.threshold
            )
            metrics.update(m)
            if self.batch_normalize:
                weights, m = normalize_is_weights(weights, mask, level=self.level, dp_sum=dp_sum)
                metrics.update(m)
        if self.rules:
            mask, m = rejection_mask(old, rollout, mask, self.rules)
            metrics.update(m)
        return weights, mask, metrics

    def decoupled(
        self, t: Trajectories
    ) -> tuple[Trajectories, torch.Tensor | None, dict[str, float]]:
        """``(the step's trajectories with the weights, the updates' mask without the
        rejected tokens or None, metrics)``."""
        dp_sum = sum_over_ranks if dp_size() > 1 else None
        weights, mask, metrics = self.weights_and_mask(
            t.old_logprobs, t.engine_logprobs, t.loss_mask, dp_sum
        )
        floats = {PREFIX + k: float(v) for k, v in metrics.items()}
        return replace(t, is_weights=weights), mask if self.rules else None, floats

    def in_loss(
        self, logprobs: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
        """Bypass mode in one micro-batch: weights and rejection of sg(π_θ) vs π_rollout
        (batch normalization over this micro-batch, as verl's bypass)."""
        weights, mask, metrics = self.weights_and_mask(logprobs.detach(), rollout, mask)
        return weights, mask, {PREFIX + k: v for k, v in metrics.items()}
