"""Run under ``torchrun --nproc-per-node=2``: each rank holds half of one batch (different
rows, different lengths); GAE and REINFORCE++ whitened with ``dp_sum`` (an all-reduce) must
give each rank its rows of the one-process whole-batch result. Writes the largest |Δ| (and
that of per-rank whitening, which must differ) to ``<out_dir>/rank<r>.json``."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ppo_core import compute_gae, compute_reinforce_pp_advantages


def whole_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 2, 6, 5, 4, 6])
    mask = (torch.arange(6) < lengths[:, None]).double()
    rewards[4:] += 3.0  # rank 1's half scores higher: per-rank statistics would differ
    return rewards, values, mask


def all_reduced(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value)
    return value


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    rewards, values, mask = whole_batch()
    mine = slice(4 * rank, 4 * rank + 4)
    valid = mask[mine].bool()
    result = {}
    for name, estimate in {
        "gae": lambda r, v, m, **kw: compute_gae(r, v, m, 1.0, 0.95, **kw),
        "reinforce_pp": lambda r, v, m, **kw: compute_reinforce_pp_advantages(r, m, 0.99, **kw),
    }.items():
        want, _ = estimate(rewards, values, mask)
        got, _ = estimate(rewards[mine], values[mine], mask[mine], dp_sum=all_reduced)
        local, _ = estimate(rewards[mine], values[mine], mask[mine])
        result[name] = float((got - want[mine])[valid].abs().max())
        result[f"{name}_per_rank"] = float((local - want[mine])[valid].abs().max())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Skip interpreter teardown (as ckpt_worker/stream_worker do): gloo aborted a rank in
    # finalization, after every result was written ("terminate called without an active
    # exception", no Python frame; dp_forward_worker in CI, 2026-12-07).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
