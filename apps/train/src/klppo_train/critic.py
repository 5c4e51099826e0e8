"""The critic's clipped value loss on one micro-batch and its optimizer step (micro-batching
and exact global-mean shares: :mod:`klppo_train.update`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from klppo_train.config import CriticConfig
from klppo_train.forward import response_values
from klppo_train.update import MicroLoss, micro_batch_step, static_micro_batch_size
from ppo_core import value_loss


@dataclass(frozen=True)
class ValueBatch:
    """Tensors of the samples one rank trains the critic on (``[B, P + T]`` and ``[B, T]``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor


def _micro_batch_loss(model: nn.Module, mb: ValueBatch, cfg: CriticConfig, counts, share: bool):
    budget = int(mb.attention_mask.sum())  # the whole micro-batch in one packed row
    values = response_values(
        model,
        mb.input_ids,
        mb.attention_mask,
        mb.response_mask.shape[1],
        max_tokens=budget,
        num_micro_batches=1,
        share_prompts=share,
    )
    return value_loss(
        values,
        mb.old_values,
        mb.returns,
        mb.response_mask,
        clip_range=cfg.cliprange_value,
        agg_mode=cfg.loss_agg_mode,
        **counts,
    )


def critic_micro_loss(cfg: CriticConfig, share_prompts: bool = False) -> MicroLoss:
    """The critic's loss on one micro-batch, as :mod:`klppo_train.update` calls it
    (``share_prompts``: :func:`klppo_train.forward.response_values`)."""
    return lambda model, mb, counts: _micro_batch_loss(model, mb, cfg, counts, share_prompts)


def critic_update_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: ValueBatch,
    cfg: CriticConfig,
    *,
    max_tokens: int,
    share_prompts: bool = False,
) -> dict[str, float]:
    """One optimizer step on this rank's part of a mini-batch, in micro-batches of at most
    ``max_tokens`` (the run's critic budget); ``critic/*`` metrics. ``share_prompts``: a
    prompt's samples run its tokens once per micro-batch."""
    return micro_batch_step(
        model,
        optimizer,
        batch,
        critic_micro_loss(cfg, share_prompts),
        max_tokens=max_tokens,
        micro_batch_size=static_micro_batch_size(
            cfg.use_dynamic_bsz, cfg.ppo_micro_batch_size_per_gpu
        ),
        grad_clip=cfg.grad_clip,
        offload_optimizer=cfg.fsdp.optimizer_offload,
        prefix="critic",
        share_prompts=share_prompts,
    )
