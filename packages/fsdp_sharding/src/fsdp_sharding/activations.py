"""Activation-memory policies: gradient checkpointing and activation offload.

Both are objects with ``.apply(model, units) -> units`` so the caller (``shard_model``)
decides where they go; both are applied *before* FSDP wraps the units, and FSDP then wraps
what ``apply`` returned (for checkpointing, the wrappers — the order torchtitan uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

# Prefixes wrappers insert into parameter names; HF names have none of them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """The HF parameter name under any wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _parents(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    return {
        id(child): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
    }


@dataclass(frozen=True)
class GradientCheckpointing:
    """Recompute each block's forward during backward (non-reentrant ``torch.utils.checkpoint``).

    Non-reentrant checkpointing works with FSDP's hooks and with inputs that do not require
    grad; the reentrant variant does neither reliably. Leaf units (embeddings, the output
    head) are not checkpointed: recomputing them saves nothing.
    """

    def apply(self, model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
        """Wrap the block units in place; return the units to shard (the wrappers)."""
        parents = _parents(model)
        wrapped = []
        for unit in units:
            if not list(unit.children()):
                wrapped.append(unit)
                continue
            parent, name = parents[id(unit)]
            wrapper = checkpoint_wrapper(unit, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            parent._modules[name] = wrapper
            wrapped.append(wrapper)
        return wrapped


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Move tensors saved for backward to CPU; parameters stay where they are (FSDP owns them)."""

    def __init__(self, pin_memory: bool) -> None:
        def pack(tensor: torch.Tensor):
            if tensor.device.type == "cpu" or isinstance(tensor, nn.Parameter):
                return tensor
            cpu = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=pin_memory)
            cpu.copy_(tensor, non_blocking=pin_memory)
            return (tensor.device, cpu)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, cpu = packed
            return cpu.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


@dataclass(frozen=True)
class ActivationOffload:
    """Offload saved activations of each unit to CPU memory during forward (pinned on CUDA)."""

    def apply(self, model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
        """Hook every unit; return the units unchanged."""
        del model
        pin = torch.cuda.is_available()
        for unit in units:
            unit.register_forward_pre_hook(partial(_enter_offload, pin=pin))
            unit.register_forward_hook(_exit_offload)
        return units


def _enter_offload(module: nn.Module, args, *, pin: bool) -> None:
    hooks = _OffloadHooks(pin)
    hooks.__enter__()
    module._klppo_offload_hooks = hooks


def _exit_offload(module: nn.Module, args, output) -> None:
    hooks = module.__dict__.pop("_klppo_offload_hooks", None)
    if hooks is not None:
        hooks.__exit__(None, None, None)
