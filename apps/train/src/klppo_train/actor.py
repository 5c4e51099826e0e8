"""One optimizer step of the actor on one mini-batch: micro-batched, exact global token-mean.

Each micro-batch's loss is its *share* of the loss over the whole mini-batch on all
data-parallel ranks (``ppo_core`` global counts), so accumulating micro-batch gradients and
averaging over ranks gives exactly the gradient of the full mini-batch loss, however the
micro-batches are cut. All ranks run the same number of micro-batches (FSDP collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from batching import sync_num_micro_batches, token_budget_micro_batches
from fsdp_sharding import clip_grad_norm
from klppo_train.config import ActorConfig
from klppo_train.forward import response_logprobs
from ppo_core import aggregate_loss, kl_penalty, masked_mean, policy_loss


@dataclass(frozen=True)
class PolicyBatch:
    """Tensors of the samples one rank trains on (``[B, P + T]`` and ``[B, T]``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> PolicyBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return PolicyBatch(**{k: None if v is None else v[index] for k, v in values.items()})


def _dp_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
    return value


def _micro_batch_loss(model, mb: PolicyBatch, cfg: ActorConfig, counts: dict, temperature: float):
    T = mb.response_mask.shape[1]
    budget = int(mb.attention_mask.sum(-1).sum())  # the whole micro-batch in one packed row
    logprobs, entropy = response_logprobs(
        model,
        mb.input_ids,
        mb.attention_mask,
        T,
        max_tokens=budget,
        temperature=temperature,
        with_entropy=cfg.entropy_coeff > 0,
        num_micro_batches=1,
    )
    loss, metrics = policy_loss(
        logprobs,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        agg_mode=cfg.loss_agg_mode,
        **counts,
    )
    if entropy is not None:
        entropy_loss = aggregate_loss(entropy, mb.response_mask, cfg.loss_agg_mode, **counts)
        loss = loss - cfg.entropy_coeff * entropy_loss
        metrics["entropy"] = masked_mean(entropy.detach(), mb.response_mask)
    if cfg.use_kl_loss and mb.ref_logprobs is not None:
        kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type)
        kl_loss = aggregate_loss(kl, mb.response_mask, cfg.loss_agg_mode, **counts)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = masked_mean(kl.detach(), mb.response_mask)
    return loss, metrics


def actor_update_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PolicyBatch,
    cfg: ActorConfig,
    *,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Forward/backward every micro-batch of ``batch`` (this rank's part of one mini-batch),
    clip, and step. Returns ``actor/*`` metrics (token-weighted over micro-batches)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mask = batch.response_mask
    counts = {
        "global_num_tokens": _dp_sum(mask.sum()),
        "global_num_seqs": _dp_sum((mask.sum(-1) > 0).sum()),
        "dp_size": world,
    }
    lengths = batch.attention_mask.sum(-1)
    plan = token_budget_micro_batches(lengths, cfg.ppo_max_token_len_per_gpu)
    plan = token_budget_micro_batches(
        lengths, cfg.ppo_max_token_len_per_gpu, num_micro_batches=sync_num_micro_batches(len(plan))
    )
    totals: dict[str, float] = {}
    for members in plan.micro_batches:
        mb = batch.rows(torch.tensor(members, device=mask.device))
        loss, metrics = _micro_batch_loss(model, mb, cfg, counts, temperature)
        loss.backward()
        # pg_loss values are shares of the global mean: they add up. The other metrics are
        # micro-batch means: weight them by tokens.
        weight = float(mb.response_mask.sum()) / max(float(mask.sum()), 1.0)
        for name, value in metrics.items():
            share = 1.0 if name == "pg_loss" else weight
            totals[f"actor/{name}"] = totals.get(f"actor/{name}", 0.0) + share * float(value)
    grad_norm = clip_grad_norm(model, cfg.grad_clip)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals["actor/grad_norm"] = float(grad_norm)
    return totals
