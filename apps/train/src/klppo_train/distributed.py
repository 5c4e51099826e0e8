"""torch.distributed for the app: one process group, data-parallel splits, metric reduction.

Under ``torchrun`` the group comes from its environment (NCCL on GPUs, gloo on CPU). A plain
single process gets a 1-rank gloo group, so FSDP sharding, weight sync and checkpoints run
the same code at world size 1. Every rank hosts its own rollout engine and works on its own
slice of each batch; the losses' global token counts (``klppo_train.update``) and FSDP's
gradient reduction make the update the same as one process on the whole batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def init_distributed() -> tuple[int, int]:
    """``(rank, world_size)``, creating the default process group if there is none."""
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timedelta(minutes=30))
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def launch_world_size() -> int:
    """The world size the launcher set up (torchrun's ``WORLD_SIZE``; 1 without it), known
    before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank_slice(items: Sequence[T]) -> list[T]:
    """This rank's contiguous share of ``items`` (the ranks' shares differ by at most one)."""
    if not dist.is_initialized():
        return list(items)
    rank, world = dist.get_rank(), dist.get_world_size()
    start, stop = (len(items) * rank) // world, (len(items) * (rank + 1)) // world
    return list(items[start:stop])


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Every rank's metrics averaged key by key (a key missing on a rank is not counted);
    ``timing_s/*`` take the slowest rank's value instead."""
    if world_size() == 1:
        return dict(metrics)
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, metrics)
    merged: dict[str, float] = {}
    for key in sorted({k for m in gathered for k in m}):
        values = [m[key] for m in gathered if key in m]
        merged[key] = max(values) if key.startswith("timing_s/") else sum(values) / len(values)
    return merged


def concat_over_ranks(counts: dict[str, list[float]]) -> dict[str, list[float]]:
    """Concatenate per-key lists from every rank (e.g. validation hits per data source)."""
    if world_size() == 1:
        return counts
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, counts)
    merged: dict[str, list[float]] = {}
    for part in gathered:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged
