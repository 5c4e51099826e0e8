"""Run under ``torchrun --nproc-per-node=2``: an FSDP2-sharded tiny actor computes response
log-probs on ranks whose sequences differ in length, so that each rank's own token-budget
plan has a different number of micro-batches (rank 0: one, rank 1: two). Every forward is
an FSDP all-gather: unless the ranks agree on the count, one rank waits for a peer that is
done (the process group's short timeout turns that hang into a failure) or pairs its
all-gathers with another pass's. The same for a sharded reward model's scores. Writes the
largest |Δ| against the unsharded models to ``<out_dir>/rank<r>.json``."""

import copy
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from test_step import scalar_head_model
from train_testing import prompt_response_batch

from batching import token_budget_micro_batches
from fsdp_sharding import ShardingConfig, shard_model
from klppo_train.demo.embedded import build_model
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.workers.forward import response_logprobs, response_scores

P, T, VOCAB, BUDGET = 8, 8, 64, 32
# Equal numbers of sequences (as the trainer's ranks hold): rank 0's 4 of 6 tokens fit one
# micro-batch, rank 1's 4 of 16 need two.
LENGTHS = {0: ([3] * 4, [3] * 4), 1: ([8] * 4, [8] * 4)}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model = build_model(VOCAB, seed=0, hidden=64)
    model.set_attn_implementation(VARLEN)
    reference = copy.deepcopy(model).eval()
    sharded = shard_model(model, ShardingConfig()).eval()
    ids, mask = prompt_response_batch(*LENGTHS[rank], P, T, VOCAB, seed=rank)
    own = len(token_budget_micro_batches(mask.sum(-1), BUDGET))
    with torch.no_grad():
        got, _ = response_logprobs(sharded, ids, mask, T, max_tokens=BUDGET)
        want, _ = response_logprobs(reference, ids, mask, T, max_tokens=BUDGET)
    valid = mask[:, P:].bool()
    diff = float((got - want)[valid].abs().max())
    rm = scalar_head_model(model, seed=2, bias=False)
    rm.set_attn_implementation(VARLEN)
    rm_reference = copy.deepcopy(rm).eval()
    rm_sharded = shard_model(rm, ShardingConfig()).eval()
    with torch.no_grad():
        scores = response_scores(rm_sharded, ids, mask, T, max_tokens=BUDGET)
        alone = response_scores(rm_reference, ids, mask, T, max_tokens=BUDGET)
    rm_diff = float((scores - alone).abs().max())
    result = {"own": own, "max_diff": diff, "rm_max_diff": rm_diff}
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
