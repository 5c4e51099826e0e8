"""``shard_model``: compose the helpers — units, activation policies, FSDP2 or FSDP1."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_sharding.activations import ActivationOffload, GradientCheckpointing
from fsdp_sharding.config import ShardingConfig
from fsdp_sharding.fsdp1 import apply_fsdp1
from fsdp_sharding.fsdp2 import apply_fsdp2
from fsdp_sharding.mesh import build_mesh, default_device
from fsdp_sharding.units import choose_shard_units

log = logging.getLogger("fsdp_sharding")


def cast_buffers(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Floating-point buffers to ``dtype`` (FSDP2 has no buffer dtype of its own)."""
    if dtype is None:
        return
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))


def apply_activation_policies(
    model: nn.Module, units: list[nn.Module], config: ShardingConfig
) -> list[nn.Module]:
    if config.gradient_checkpointing:
        units = GradientCheckpointing().apply(model, units)
        log.info("gradient checkpointing (non-reentrant) on %d units", len(units))
    if config.activation_offload:
        units = ActivationOffload().apply(model, units)
        log.info("activation offload to CPU on %d units", len(units))
    return units


def shard_model(
    model: nn.Module,
    config: ShardingConfig,
    *,
    mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """Shard a (HF) model with FSDP2 or FSDP1 as ``config`` says; logs each decision.

    Call after ``torch.distributed.init_process_group`` on every rank, with the same model
    (same init) on every rank. Build the optimizer from the returned model's parameters.

    Args:
        model: the full model (on CPU or its device).
        config: the sharding levers.
        mesh: a device mesh to use; default one from ``config.fsdp_size``.
        device: this rank's device; default its CUDA device under NCCL, else CPU.

    Returns:
        The sharded model (FSDP2: the same object, now an ``FSDPModule``; FSDP1: the wrapper).
    """
    device = device or default_device()
    mesh = mesh or build_mesh(config.fsdp_size, device)
    precision = config.precision_for(device)
    units = choose_shard_units(model, config)
    log.info("shard units: %d (%s)", len(units), sorted({type(u).__name__ for u in units}))
    cast_buffers(model, precision.buffer)
    units = apply_activation_policies(model, units, config)
    if config.strategy == "fsdp2":
        return apply_fsdp2(model, units, config, precision, mesh)
    return apply_fsdp1(model, units, config, precision, mesh, device)
