"""Keep the number of micro-batches equal across data-parallel ranks.

FSDP (and DDP) run collectives inside every forward/backward; a rank that runs one more
micro-batch than its peers waits forever in a collective the others never enter. Each
rank plans its own micro-batches, then all agree on the largest count and re-plan with it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduction_device(group) -> torch.device:
    # NCCL reduces only CUDA tensors; gloo (CPU) only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_num_micro_batches(num_micro_batches: int, group=None) -> int:
    """The largest ``num_micro_batches`` over the ranks of ``group`` (all-reduce MAX).

    Call it on every rank, then re-plan with ``token_budget_micro_batches(...,
    num_micro_batches=<result>)``. Without an initialized process group it returns the
    input unchanged (single process).

    Args:
        num_micro_batches: this rank's count.
        group: process group (default: the world).

    Returns:
        The count every rank must use.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return num_micro_batches
    count = torch.tensor([num_micro_batches], dtype=torch.int64, device=_reduction_device(group))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())
