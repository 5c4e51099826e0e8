"""Stream the full (unsharded) weights one parameter at a time, with HF names.

This feeds weight sync to a rollout engine: gathering the whole state dict would need
memory for the full model on every rank; streaming keeps the extra memory at one
parameter (or one bucket). Every rank must iterate to the end in the same order, since
each step is a collective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from fsdp_sharding.activations import clean_name


def _fsdp2_stream(
    model: nn.Module, dtype: torch.dtype | None, trainable_only: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        yield clean_name(name), full.to(dtype) if dtype is not None else full


def _fsdp1_stream(
    model: FSDP, dtype: torch.dtype | None, trainable_only: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    # One unit at a time: summon_full_params(recurse=False) gathers only that unit's
    # flat parameter, so the extra memory is one unit. Parameters of nested units are
    # still sharded inside it and are streamed when their own unit comes.
    for unit in FSDP.fsdp_modules(model):
        nested = {
            id(p) for sub in FSDP.fsdp_modules(unit) if sub is not unit for p in sub.parameters()
        }
        prefix = _prefix_of(model, unit)
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for name, param in unit.named_parameters(remove_duplicate=True):
                if id(param) in nested or (trainable_only and not param.requires_grad):
                    continue
                full = param.detach().clone()
                yield clean_name(prefix + name), full.to(dtype) if dtype is not None else full


def _prefix_of(root: nn.Module, unit: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is unit:
            return name + "." if name else ""
    raise ValueError("FSDP unit not found under the root")


def iter_full_state_dict(
    model: nn.Module, *, dtype: torch.dtype | None = None, trainable_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter, one at a time, on every rank.

    Args:
        model: a model returned by ``shard_model`` (FSDP2 or FSDP1), or a plain module.
        dtype: cast each full tensor (e.g. bf16 for a bf16 rollout engine).
        trainable_only: only parameters that require grad (a LoRA model's adapters: the
            frozen base is never gathered).

    Yields:
        Parameter names as the unwrapped HF model names them, and full tensors on the
        parameter's device. Tied weights appear once.
    """
    if isinstance(model, FSDP):
        yield from _fsdp1_stream(model, dtype, trainable_only)
    else:
        yield from _fsdp2_stream(model, dtype, trainable_only)
