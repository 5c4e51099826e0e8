"""Memory levers for the hybrid engine: move shards and optimizer states off the GPU while
the rollout engine generates, and back before the next update."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def _move_fsdp1_shards(model: nn.Module, device: torch.device) -> None:
    # FSDP1 keeps one flat parameter per unit; its local shard must follow the data.
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        flat.data = flat.data.to(device, non_blocking=True)
        flat._local_shard = flat.data


def offload_model(model: nn.Module) -> None:
    """Move this rank's parameter shards (and buffers) to CPU."""
    load_model(model, torch.device("cpu"))


def load_model(model: nn.Module, device: torch.device | str) -> None:
    """Move this rank's parameter shards (and buffers) to ``device``.

    FSDP2 handles ``Module.to`` on its sharded DTensor parameters; FSDP1's flat shards are
    moved by hand.
    """
    device = torch.device(device)
    if isinstance(model, FSDP):
        _move_fsdp1_shards(model, device)
        for buffer in model.buffers():
            buffer.data = buffer.data.to(device)
    else:
        model.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move every optimizer state tensor (Adam moments, step counts) to CPU."""
    load_optimizer(optimizer, torch.device("cpu"))


def load_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every optimizer state tensor to ``device``."""
    device = torch.device(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
