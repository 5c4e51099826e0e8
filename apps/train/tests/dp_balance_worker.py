"""Run under ``torchrun --nproc-per-node=2``: rank 0's prompts drew long responses, rank 1's
short ones; ``balance_rollouts`` re-splits the groups. Writes what each rank holds after it
to ``<out_dir>/rank<r>.json``."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.balance import balance_rollouts
from rollout import RolloutBatch, Sample

N = 2  # samples per prompt
# (prompt length, response lengths of its N samples), per rank: 4 prompts each
GROUPS = {
    0: [(5, (40, 38)), (6, (35, 30)), (5, (33, 31)), (7, (29, 28))],
    1: [(5, (3, 2)), (6, (4, 4)), (5, (2, 3)), (7, (1, 5))],
}


def rank_rollouts(rank: int) -> tuple[list[PromptItem], RolloutBatch]:
    items, samples = [], []
    for i, (prompt_len, responses) in enumerate(GROUPS[rank]):
        index = 4 * rank + i  # the dataset row: identifies the group after the exchange
        items.append(PromptItem(index, "arithmetic", (1,) * prompt_len, "0"))
        for j, length in enumerate(responses):
            samples.append(Sample(i, (100 * index + j,) * length, (0.0,) * length, "stop", 0))
    return items, RolloutBatch(samples, 0)


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    items, batch, metrics, positions = balance_rollouts(*rank_rollouts(rank))
    held = {
        "rows": [item.index for item in items],
        "positions": positions,
        "prompt_index": [s.prompt_index for s in batch.samples],
        # each sample's first token encodes (row, sample) of its origin
        "origin": [s.response_token_ids[0] for s in batch.samples],
        "tokens": sum(len(i.prompt_ids) for i in items) * N
        + sum(len(s.response_token_ids) for s in batch.samples),
        **metrics,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(held))
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
