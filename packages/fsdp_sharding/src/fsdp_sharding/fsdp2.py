"""FSDP2 (``fully_shard``): per-unit sharding, reshard policy and explicit prefetch."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp_sharding.config import MixedPrecision, ShardingConfig

log = logging.getLogger("fsdp_sharding")


def reshard_policy(config: ShardingConfig, index: int, num_units: int) -> bool | int:
    """``reshard_after_forward`` for unit ``index`` of ``num_units``.

    The last unit keeps its parameters after forward: backward starts with it, so
    resharding would only be followed by an immediate all-gather (torchtitan does the same).
    """
    if config.reshard_after_forward is True and index == num_units - 1:
        return False
    return config.reshard_after_forward


def fsdp2_kwargs(config: ShardingConfig, precision: MixedPrecision, mesh: DeviceMesh) -> dict:
    """Arguments shared by every ``fully_shard`` call."""
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=precision.param, reduce_dtype=precision.reduce
        ),
    }
    if config.offload_policy or config.param_offload:
        # Pinning needs an accelerator; without one the policy still runs (and changes nothing).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return kwargs


def wire_prefetch(units: list[FSDPModule], config: ShardingConfig) -> None:
    """Explicit forward/backward prefetch lists (FSDP2 does neither across units by itself
    beyond its implicit one-unit backward prefetch)."""
    depth = config.forward_prefetch_depth
    for i, unit in enumerate(units):
        if depth and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        if config.backward_prefetch and i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    log.info(
        "fsdp2 prefetch: forward depth %d, backward %s over %d units",
        depth,
        config.backward_prefetch,
        len(units),
    )


def apply_fsdp2(
    model: nn.Module,
    units: list[nn.Module],
    config: ShardingConfig,
    precision: MixedPrecision,
    mesh: DeviceMesh,
) -> nn.Module:
    """``fully_shard`` every unit (forward order), then the root; wire prefetch."""
    kwargs = fsdp2_kwargs(config, precision, mesh)
    for i, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=reshard_policy(config, i, len(units)), **kwargs)
    # The root's leftovers (final norm, tied embeddings) are needed right at backward start.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    wire_prefetch(units, config)
    log.info(
        "fsdp2: %d units of %s + root, reshard_after_forward=%s, %s",
        len(units),
        sorted({type(u).__name__ for u in units}),
        config.reshard_after_forward,
        describe_precision(precision, kwargs),
    )
    return model


def describe_precision(precision: MixedPrecision, kwargs: dict) -> str:
    offload = "cpu offload" if "offload_policy" in kwargs else "no offload"
    return (
        f"params {precision.param_dtype}, reduce {precision.reduce_dtype}, "
        f"buffers {precision.buffer_dtype}, {offload}"
    )
