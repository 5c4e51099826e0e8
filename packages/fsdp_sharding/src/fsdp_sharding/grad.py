"""Gradient clipping that works on FSDP2 (DTensor) and FSDP1 (flat) gradients."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

    A non-finite norm (overflow, NaN loss) leaves the gradients untouched, so the caller
    can test ``torch.isfinite(norm)`` and skip the optimizer step.

    Returns:
        Scalar tensor on this rank's device: the total L2 norm over all ranks' shards.
    """
    if isinstance(model, FSDP):
        # FSDP1 reduces the norm over its flat shards itself; it clips even when non-finite.
        return model.clip_grad_norm_(max_norm)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # the partial norms of all shards, reduced
    if torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, norm
        )
    return norm
