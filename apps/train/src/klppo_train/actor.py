"""The actor's loss on one micro-batch (clipped policy loss, entropy bonus, KL loss) and its
optimizer step (micro-batching and exact global-mean shares: :mod:`klppo_train.update`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from klppo_train.config import ActorConfig
from klppo_train.forward import response_logprobs
from klppo_train.update import MicroLoss, micro_batch_step, static_micro_batch_size
from ppo_core import aggregate_loss, kl_penalty, masked_mean, policy_loss
from rollout import logprob_mismatch


@dataclass(frozen=True)
class PolicyBatch:
    """Tensors of the samples one rank trains on (``[B, P + T]`` and ``[B, T]``).

    ``old_logprobs=None`` is the on-policy step (one mini-batch, one epoch): the policy has
    not moved since it generated, so logπ_old = sg(logπ) (ratio 1, verl's shortcut) and no
    separate old-log-prob pass is needed. The train/rollout mismatch and the entropy are
    then measured in the update's own forward (``engine_logprobs``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None


def _micro_batch_loss(
    model, mb: PolicyBatch, cfg: ActorConfig, counts: dict, temperature: float, share: bool
):
    T = mb.response_mask.shape[1]
    budget = int(mb.attention_mask.sum(-1).sum())  # the whole micro-batch in one packed row
    on_policy = mb.old_logprobs is None
    logprobs, entropy = response_logprobs(
        model,
        mb.input_ids,
        mb.attention_mask,
        T,
        max_tokens=budget,
        temperature=temperature,
        with_entropy=cfg.entropy_coeff > 0 or on_policy,
        num_micro_batches=1,
        share_prompts=share,
    )
    loss, metrics = policy_loss(
        logprobs,
        logprobs.detach() if on_policy else mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        agg_mode=cfg.loss_agg_mode,
        **counts,
    )
    if entropy is not None:
        if cfg.entropy_coeff > 0:
            entropy_loss = aggregate_loss(entropy, mb.response_mask, cfg.loss_agg_mode, **counts)
            loss = loss - cfg.entropy_coeff * entropy_loss
        metrics["entropy"] = masked_mean(entropy.detach(), mb.response_mask)
    if on_policy and mb.engine_logprobs is not None:
        metrics.update(logprob_mismatch(mb.engine_logprobs, logprobs.detach(), mb.response_mask))
    if cfg.use_kl_loss and mb.ref_logprobs is not None:
        kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type)
        kl_loss = aggregate_loss(kl, mb.response_mask, cfg.loss_agg_mode, **counts)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = masked_mean(kl.detach(), mb.response_mask)
    return loss, metrics


def actor_micro_loss(
    cfg: ActorConfig, temperature: float = 1.0, share_prompts: bool = False
) -> MicroLoss:
    """The actor's loss on one micro-batch, as :mod:`klppo_train.update` calls it
    (``share_prompts``: :func:`klppo_train.forward.response_logprobs`)."""
    return lambda model, mb, counts: _micro_batch_loss(
        model, mb, cfg, counts, temperature, share_prompts
    )


def actor_update_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PolicyBatch,
    cfg: ActorConfig,
    *,
    max_tokens: int,
    temperature: float = 1.0,
    share_prompts: bool = False,
) -> dict[str, float]:
    """One optimizer step on this rank's part of a mini-batch, in micro-batches of at most
    ``max_tokens`` (the run's actor budget, :mod:`klppo_train.budgets`); ``actor/*``
    metrics. ``share_prompts``: a prompt's samples run its tokens once per micro-batch."""
    return micro_batch_step(
        model,
        optimizer,
        batch,
        actor_micro_loss(cfg, temperature, share_prompts),
        max_tokens=max_tokens,
        micro_batch_size=static_micro_batch_size(
            cfg.use_dynamic_bsz, cfg.ppo_micro_batch_size_per_gpu
        ),
        grad_clip=cfg.grad_clip,
        offload_optimizer=cfg.fsdp.optimizer_offload,
        prefix="actor",
        share_prompts=share_prompts,
    )
