"""Run under `torchrun --nproc-per-node=2`: each rank plans its own micro-batches, the ranks
agree on the MAX count, re-plan with it, and run one real collective per micro-batch (as
FSDP does). Writes what it saw to <out_dir>/rank<r>.json."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from batching import sync_num_micro_batches, token_budget_micro_batches

# Rank 0 holds short sequences (2 micro-batches), rank 1 long ones (4 micro-batches).
LENGTHS = {0: [300, 200, 250, 100, 150, 400], 1: [900, 800, 950, 700, 600, 850]}
BUDGET = 1000


def main(out_dir: Path) -> None:
    # A short timeout turns a mismatched count (a hang in real FSDP) into a failure.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    lens = LENGTHS[rank]
    own = token_budget_micro_batches(lens, BUDGET)
    synced = sync_num_micro_batches(len(own))
    plan = token_budget_micro_batches(lens, BUDGET, num_micro_batches=synced)
    steps = 0
    for micro_batch in plan.micro_batches:
        tokens = torch.tensor([sum(lens[i] for i in micro_batch)], dtype=torch.int64)
        dist.all_reduce(tokens)  # stands in for FSDP's all-gather / reduce-scatter
        steps += 1
    result = {"own": len(own), "synced": synced, "steps": steps, "sums": list(plan.token_sums)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # Both ranks done talking before teardown: a rank tearing gloo down while its peer
    # is still busy aborted once ("terminate called without an active exception").
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
