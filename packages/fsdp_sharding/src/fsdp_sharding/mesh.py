"""The device mesh one model is sharded over: 1-D (shard) or 2-D (replicate × shard)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def default_device() -> torch.device:
    """This rank's device: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(fsdp_size: int, device: torch.device) -> DeviceMesh:
    """Shard over all ranks (``fsdp_size`` −1 or the world size), or over groups of
    ``fsdp_size`` ranks replicated world / fsdp_size times (hybrid sharding: all-gathers stay
    inside a node, only the gradient all-reduce crosses nodes)."""
    world = dist.get_world_size()
    if fsdp_size == -1 or fsdp_size == world:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    if world % fsdp_size:
        raise ValueError(
            f"ShardingConfig.fsdp_size={fsdp_size} does not divide the world size {world}"
        )
    return init_device_mesh(
        device.type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard")
    )
