"""One optimizer step over token-budget micro-batches, shared by the actor and the critic.

Each micro-batch's loss is its *share* of the loss over the whole mini-batch on all
data-parallel ranks (``ppo_core`` global counts), so accumulating micro-batch gradients and
averaging over ranks gives exactly the gradient of the full mini-batch loss, however the
micro-batches are cut. All ranks run the same number of micro-batches (FSDP collectives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from batching import micro_batch_plan, prompt_prefixes
from fsdp_sharding import clip_grad_norm, load_optimizer
from fsdp_sharding import offload_optimizer as offload_optimizer_state
from klppo_train.distributed import sum_over_ranks, world_size
from ppo_core import SHARE_METRICS

MicroLoss = Callable[[nn.Module, Any, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def select_rows(batch: Any, index: torch.Tensor) -> Any:
    """The same dataclass with every tensor field indexed by ``index`` (None stays None)."""
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v[index] for k, v in values.items() if v is not None})


def _aggregate(totals: dict[str, float], name: str, value: float, weight: float) -> None:
    # Maxima over tokens (``*_max``): the step's is the largest micro-batch's.
    if name.endswith("_max"):
        totals[name] = max(totals.get(name, value), value)
    else:
        totals[name] = totals.get(name, 0.0) + weight * value


def static_micro_batch_size(use_dynamic_bsz: bool | None, micro_batch_size: int) -> int | None:
    """The fixed micro-batch size of verl's static mode (``use_dynamic_bsz=False``), or None
    for token-budget micro-batches (True, or None: not resolved, the actor's default)."""
    return micro_batch_size if use_dynamic_bsz is False else None


def global_counts(response_mask: torch.Tensor) -> dict[str, Any]:
    """Valid tokens and sequences of the mini-batch over all ranks, for ``ppo_core`` losses."""
    world = world_size()
    return {
        "global_num_tokens": sum_over_ranks(response_mask.sum()),
        "global_num_seqs": sum_over_ranks((response_mask.sum(-1) > 0).sum()),
        "dp_size": world,
    }


def accumulate_gradients(
    model: nn.Module,
    batch: Any,
    micro_loss: MicroLoss,
    *,
    max_tokens: int,
    micro_batch_size: int | None = None,
    prefix: str,
    share_prompts: bool = False,
) -> dict[str, float]:
    """Backward every micro-batch of ``batch`` (fields ``input_ids``, ``attention_mask``,
    ``response_mask``) into the gradients; ``{prefix}/*`` metrics, token-weighted (a name
    with its own ``/`` is kept as is; ``*_max`` metrics take the maximum). Micro-batches:
    within ``max_tokens``, or of ``micro_batch_size`` sequences (static); with
    ``share_prompts`` a prompt's samples stay together and its prefix counts once (the
    loss must then pack them shared: ``batching.pack_shared_prompts``)."""
    mask = batch.response_mask
    counts = global_counts(mask)
    # Every rank the same number of micro-batches: FSDP's collectives pair up.
    lengths = batch.attention_mask.sum(-1)
    prefixes = None
    if share_prompts:
        prompt_length = batch.input_ids.shape[1] - mask.shape[1]
        prefixes = prompt_prefixes(batch.input_ids, batch.attention_mask, prompt_length)
    plan = micro_batch_plan(
        lengths, max_tokens, micro_batch_size, sync_ranks=True, prefixes=prefixes
    )
    totals: dict[str, float] = {}
    for members in plan.micro_batches:
        mb = select_rows(batch, torch.tensor(members, device=mask.device))
        loss, metrics = micro_loss(model, mb, counts)
        loss.backward()
        weight = float(mb.response_mask.sum()) / max(float(mask.sum()), 1.0)
        for name, value in metrics.items():
            share = 1.0 if name in SHARE_METRICS else weight
            _aggregate(totals, name if "/" in name else f"{prefix}/{name}", float(value), share)
    return totals


def micro_batch_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    micro_loss: MicroLoss,
    *,
    max_tokens: int,
    micro_batch_size: int | None = None,
    grad_clip: float,
    prefix: str,
    offload_optimizer: bool = False,
    share_prompts: bool = False,
) -> dict[str, float]:
    """:func:`accumulate_gradients`, clip, step (skipped on a non-finite norm), zero the
    gradients; the metrics with ``{prefix}/grad_norm``. ``offload_optimizer``: the
    optimizer state lives on CPU except during its step."""
    totals = accumulate_gradients(
        model,
        batch,
        micro_loss,
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        prefix=prefix,
        share_prompts=share_prompts,
    )
    grad_norm = clip_grad_norm(model, grad_clip)
    if torch.isfinite(grad_norm):
        if offload_optimizer:
            load_optimizer(optimizer, next(model.parameters()).device)
        optimizer.step()
        if offload_optimizer:
            offload_optimizer_state(optimizer)
    optimizer.zero_grad(set_to_none=True)
    totals[f"{prefix}/grad_norm"] = float(grad_norm)
    return totals
