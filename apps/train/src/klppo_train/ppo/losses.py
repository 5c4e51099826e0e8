"""The actor's and the critic's loss on one micro-batch, as objects built once with their
hyperparameters (as torchtune builds its losses): ``loss(model, micro_batch, counts)`` →
``(loss, metrics)``.

Each micro-batch's loss is its *share* of the loss over the whole mini-batch on all
data-parallel ranks (``counts``: :class:`GlobalCounts`), so accumulating micro-batch
gradients and averaging over ranks gives exactly the gradient of the full mini-batch loss,
however the micro-batches are cut (:mod:`klppo_train.workers.trainee`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from klppo_train.ppo.rollout_correction import RolloutCorrection
from klppo_train.runtime.sequence_parallel import SequenceParallel
from klppo_train.workers.forward import NO_SP, response_logprobs, response_values
from klppo_train.workers.losses import GlobalCounts, Metrics
from klppo_train.workers.trajectories import Trajectories
from ppo_core import (
    aggregate_loss,
    clipped_policy_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
    reinforce_loss,
    value_loss,
)
from rollout import logprob_mismatch


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss ``loss_mode`` (ppo_core's ``POLICY_LOSSES``: PPO's clip by default)
    with its ``hyperparameters``, aggregated by ``policy_agg_mode``, + entropy bonus + KL
    loss (``actor.*``, aggregated by ``loss_agg_mode``), on the response tokens' log-probs
    at the sampling ``temperature``.

    ``mb.old_logprobs=None`` is the on-policy step (one mini-batch, one epoch): the policy
    has not moved since it generated, so logπ_old = sg(logπ) (ratio 1, verl's shortcut); the
    train/rollout mismatch and the entropy are then measured in this forward
    (``mb.engine_logprobs``), as in bypass mode. ``share_prompts``: a prompt's samples run
    its tokens once. ``mb.is_weights`` (rollout correction) multiply each token's loss;
    ``bypass`` (rollout correction's bypass mode: ``mb.old_logprobs`` are the engine's)
    computes weights and rejection here, per micro-batch.
    """

    loss_mode: str
    hyperparameters: tuple[tuple[str, Any], ...]
    policy_agg_mode: str
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float = 1.0
    share_prompts: bool = False
    sp: SequenceParallel = NO_SP
    bypass: RolloutCorrection | None = None

    def __call__(
        self, model: nn.Module, mb: Trajectories, counts: GlobalCounts
    ) -> tuple[torch.Tensor, Metrics]:
        on_policy = mb.old_logprobs is None
        measures = on_policy or self.bypass is not None  # no old-log-prob pass measured it
        logprobs, entropy = response_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.response_length,
            max_tokens=None,  # the micro-batch the trainee planned, as it is
            temperature=self.temperature,
            with_entropy=self.entropy_coeff > 0 or measures,
            share_prompts=self.share_prompts,
            sp=self.sp,
        )
        if self.bypass is not None:
            loss, metrics = self._bypass_loss(logprobs, mb, counts)
        else:
            loss, metrics = policy_loss(
                logprobs,
                logprobs.detach() if on_policy else mb.old_logprobs,
                mb.advantages,
                mb.loss_mask,
                loss_mode=self.loss_mode,
                is_weights=mb.is_weights,
                **self._loss_kwargs(counts),
            )
        if entropy is not None:
            loss = self._entropy_bonus(loss, entropy, mb, counts, metrics)
        if measures:
            metrics.update(logprob_mismatch(mb.engine_logprobs, logprobs.detach(), mb.loss_mask))
        if self.use_kl_loss and mb.ref_logprobs is not None:
            kl = kl_penalty(logprobs, mb.ref_logprobs, self.kl_loss_type)
            kl_loss = aggregate_loss(kl, mb.loss_mask, self.loss_agg_mode, **counts.kwargs())
            loss = loss + self.kl_loss_coef * kl_loss
            metrics["kl_loss"] = masked_mean(kl.detach(), mb.loss_mask)
        return loss, metrics

    def _loss_kwargs(self, counts: GlobalCounts) -> dict:
        return dict(self.hyperparameters, agg_mode=self.policy_agg_mode, **counts.kwargs())

    def _bypass_loss(
        self, logprobs: torch.Tensor, mb: Trajectories, counts: GlobalCounts
    ) -> tuple[torch.Tensor, Metrics]:
        """verl's bypass mode: ``ppo_clip`` clips the ratio to π_rollout over the kept tokens
        (weights only measured); ``reinforce`` is −A·log π_θ·w over them. The global counts
        stay those of the whole mask (a rejected token counts as a 0 loss)."""
        weights, mask, metrics = self.bypass.in_loss(logprobs, mb.old_logprobs, mb.loss_mask)
        if self.bypass.loss_type == "reinforce":
            loss, more = reinforce_loss(
                logprobs, mb.advantages, mask, is_weights=weights,
                agg_mode=self.policy_agg_mode, **counts.kwargs(),
            )  # fmt: skip
        else:
            loss, more = clipped_policy_loss(
                logprobs, mb.old_logprobs, mb.advantages, mask, **self._loss_kwargs(counts)
            )
        return loss, {**metrics, **more}

    def _entropy_bonus(self, loss, entropy, mb: Trajectories, counts, metrics) -> torch.Tensor:
        if self.entropy_coeff > 0:
            bonus = aggregate_loss(entropy, mb.loss_mask, self.loss_agg_mode, **counts.kwargs())
            loss = loss - self.entropy_coeff * bonus
        metrics["entropy"] = masked_mean(entropy.detach(), mb.loss_mask)
        return loss


@dataclass(frozen=True)
class ValueLoss:
    """The critic's clipped value loss (``critic.cliprange_value``) against ``mb.returns``,
    clipped around the values before the update (``mb.values``)."""

    cliprange_value: float
    loss_agg_mode: str
    share_prompts: bool = False
    sp: SequenceParallel = NO_SP

    def __call__(
        self, model: nn.Module, mb: Trajectories, counts: GlobalCounts
    ) -> tuple[torch.Tensor, Metrics]:
        values = response_values(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.response_length,
            max_tokens=None,  # the micro-batch the trainee planned, as it is
            share_prompts=self.share_prompts,
            sp=self.sp,
        )
        return value_loss(
            values,
            mb.values,
            mb.returns,
            mb.loss_mask,
            clip_range=self.cliprange_value,
            agg_mode=self.loss_agg_mode,
            **counts.kwargs(),
        )
