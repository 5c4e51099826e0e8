"""Time and peak memory of one pass on this device, and how much memory a pass may take.

CUDA: ``max_memory_allocated`` after a reset, over what was allocated before. CPU: the
process's peak RSS (``VmHWM`` after writing 5 to ``/proc/self/clear_refs``) over its RSS
when the series began, with the allocator's free memory handed back to the OS then
(tcmalloc when preloaded, else glibc's ``malloc_trim``), so that what earlier roles left
cached does not hide a pass's need. Used by :mod:`klppo_train.trainer.probe` and
``benchmarks/budget_bench.py``.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

import torch

from batching import ProbePoint
from fsdp_sharding import default_device
from klppo_train.budgets.run_budgets import release_memory as release_cached
from klppo_train.ppo.components import Components
from klppo_train.runtime.process_group import world_size

GIB = 2**30


def _proc_kib(field: str, path: str = "/proc/self/status") -> int:
    """A ``<field>: <n> kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``)."""
    with open(path) as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{path} has no {field}")


def _release_to_os() -> None:
    """Hand the allocator's free memory back (tcmalloc when preloaded, else glibc)."""
    process = ctypes.CDLL(None)
    for name in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):
        function = getattr(process, name, None)
        if function is not None:
            function(*([0] if name == "malloc_trim" else []))
            return


def _sync() -> None:
    if default_device().type == "cuda":
        torch.cuda.synchronize()


class PassMeter:
    """Time and peak memory growth of a series of passes of one role, in increasing size.

    Free memory is handed back once, when the meter is made; each pass's growth is then
    measured from that base. Passes of increasing size each need more than any before
    left cached, so the growth is their need (CUDA measures it exactly anyway), while the
    time is taken with a warm allocator, as in a real step.
    """

    def __init__(self) -> None:
        release_cached()
        self.cuda = default_device().type == "cuda"
        if not self.cuda:
            _release_to_os()
            self.base = _proc_kib("VmRSS") * 1024

    def __call__(self, run: Callable[[], None], tokens: int) -> ProbePoint:
        """One ``run()`` of a ``tokens``-token pass."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM := VmRSS
            base = self.base
        start = time.perf_counter()
        run()
        _sync()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if self.cuda else _proc_kib("VmHWM") * 1024
        return ProbePoint(tokens, seconds, max(peak - base, 0) / GIB)


def agree(point: ProbePoint) -> ProbePoint:
    """Under torchrun: the slowest time and the largest memory of any rank."""
    if world_size() == 1:
        return point
    values = torch.tensor([point.seconds, point.memory_gib], dtype=torch.float64)
    values = values.to(default_device())
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    seconds, memory = values.tolist()
    return ProbePoint(point.budget, seconds, memory)


def _optimizer_state_gib(c: Components) -> float:
    """AdamW's two fp32 moments per trainable parameter of this rank's shards, created at
    the first step (after the probe): memory the passes cannot have."""
    total = 0
    for model in c.models():
        total += sum(_local_numel(p) for p in model.parameters() if p.requires_grad)
    return 8 * total / GIB


def _local_numel(param: torch.Tensor) -> int:
    local = getattr(param, "to_local", None)  # a DTensor shard (FSDP2)
    return (local() if local else param).numel()


def memory_allowance(limit_gib: float, c: Components) -> tuple[float, dict[str, float]]:
    """GiB one pass may add under ``trainer.memory_limit_gib`` (``limit_gib``; 0 = in use now
    + 90 % of the GPU's free memory / 80 % of the available RAM), and how that was worked
    out."""
    cuda = default_device().type == "cuda"
    if cuda:
        free, total = (x / GIB for x in torch.cuda.mem_get_info())
        share, default_fraction = 1, 0.9
    else:
        free, total = (_proc_kib(f, "/proc/meminfo") / 2**20 for f in ("MemAvailable", "MemTotal"))
        share, default_fraction = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 0.8
    in_use = total - free
    limit = limit_gib or in_use + default_fraction * free
    optimizer = _optimizer_state_gib(c)
    allowance = (limit - in_use) / share - optimizer
    return allowance, {
        "limit_gib": limit,
        "in_use_gib": in_use,
        "optimizer_state_gib": optimizer,
        "ranks_sharing": share,
        "allowance_gib": allowance,
    }
