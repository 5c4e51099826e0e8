"""``model.dtype``: the compute dtype of actor, critic, reference and rollout, resolved once.

``float32`` / ``bfloat16`` are taken as given. ``auto`` is bf16 on CUDA; on a CPU it is bf16
only where a short matmul probe shows bf16 clearly faster than fp32: CPUs with AVX512-BF16
or AMX run bf16 matmuls ~4x faster, CPUs with AVX2 only run them 3–8x *slower* (measured on
two machines of our CI's kind). The probe's numbers and the choice are logged.

Trained models keep fp32 master weights and optimizer state; FSDP casts the parameters to
the compute dtype for forward/backward and reduces gradients in fp32. The frozen reference
is stored in the compute dtype outright.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fsdp_sharding import MixedPrecision, ShardingConfig
from klppo_train.config.choices import DTYPES

# bf16 must beat fp32 by this much on the probe: casts, norms and softmax in fp32 eat part
# of the matmul gain.
BF16_MIN_SPEEDUP = 1.5
log = logging.getLogger("klppo_train")


@dataclass(frozen=True)
class Precision:
    """The resolved ``model.dtype``: ``dtype`` and why (the probe's numbers, for ``auto``)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.15) -> float:
    """Achieved GFLOP/s of ``[size, size] @ [size, size]`` in ``dtype`` on the CPU."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up (kernel selection, packing buffers)
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 2:
        a @ b
        runs += 1
    return 2 * size**3 * runs / elapsed / 1e9


def choose_cpu_dtype(fp32_gflops: float, bf16_gflops: float) -> Precision:
    """bf16 where its matmul is at least ``BF16_MIN_SPEEDUP`` times fp32's, else fp32."""
    ratio = bf16_gflops / fp32_gflops
    probe = f"bf16 matmul {bf16_gflops:.0f} GFLOP/s vs fp32 {fp32_gflops:.0f} ({ratio:.2f}x)"
    if ratio >= BF16_MIN_SPEEDUP:
        return Precision(torch.bfloat16, f"auto: {probe} -> bfloat16")
    return Precision(
        torch.float32, f"auto: {probe}, under {BF16_MIN_SPEEDUP}x -> float32 (no fast bf16 here)"
    )


def _decide(setting: str, device: torch.device) -> Precision:
    if setting != "auto":
        return Precision(getattr(torch, setting), f"model.dtype={setting}")
    if device.type == "cuda":
        return Precision(torch.bfloat16, "auto: bfloat16 on CUDA")
    return choose_cpu_dtype(matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16))


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """The compute dtype for ``model.dtype=setting`` on ``device``; logs the decision.

    Under torch.distributed rank 0 decides (probes) and every rank takes its choice: ranks
    that disagreed on a dtype would run different programs.
    """
    if setting not in DTYPES:
        raise ValueError(f"model.dtype={setting!r}; valid: {', '.join(DTYPES)}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [_decide(setting, device) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    else:
        choice = _decide(setting, device)
    log.info("compute dtype %s (%s)", choice.name, choice.reason)
    return choice


def role_sharding(fsdp: ShardingConfig, compute: torch.dtype) -> ShardingConfig:
    """A role's ``fsdp`` section with its dtypes completed: unset ``mixed_precision`` fields
    are ``compute`` (``model.dtype``) for the parameters in forward/backward and float32 for
    the gradient reduce and the buffers (rotary frequencies)."""
    mixed = fsdp.mixed_precision or MixedPrecision()
    return replace(
        fsdp,
        mixed_precision=MixedPrecision(
            param_dtype=mixed.param_dtype or compute,
            reduce_dtype=mixed.reduce_dtype or "float32",
            buffer_dtype=mixed.buffer_dtype or "float32",
        ),
    )
