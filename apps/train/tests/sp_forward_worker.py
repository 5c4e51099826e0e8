"""Run under ``torchrun --nproc-per-node=2``: Ulysses sequence parallelism (sp = 2) against
the same models on the whole row (sp = 1), on a batch of uneven lengths whose packed rows
are of odd length (padded for the split). For a GQA model whose key/value heads split over
the ranks (4 query / 2 KV heads) and one whose single KV head is repeated (2 / 1), plain and
FSDP2-sharded over both ranks: the actor's log-probs and entropies, a critic's values, a
reward model's scores, and the gradients of a loss of all three (the mean over the ranks,
as FSDP reduces them). Writes the largest |Δ| of each (of a gradient: over its largest
entry) to ``<out_dir>/rank<r>.json``."""

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

from fsdp_sharding import ShardingConfig, shard_model
from klppo_train.demo.embedded import build_model
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.runtime.sequence_parallel import sequence_parallel
from klppo_train.workers.forward import NO_SP, response_logprobs, response_scores, response_values

P, T, VOCAB, BUDGET = 8, 8, 64, 40  # 40 tokens: three micro-batches
PROMPTS, RESPONSES = [8, 3, 5, 1, 6], [7, 2, 8, 0, 5]  # 45 tokens: odd rows


def models(hidden: int) -> list[torch.nn.Module]:
    actor = build_model(VOCAB, seed=0, hidden=hidden)
    critic = scalar_head_model(actor, seed=1)
    reward = scalar_head_model(actor, seed=2, bias=False)
    for model in (actor, critic, reward):
        model.set_attn_implementation(VARLEN)
    return [actor, critic, reward]


def tokens_seen(model: torch.nn.Module) -> list[int]:
    """The token count of each forward of ``model``'s embedding, appended as they run."""
    seen: list[int] = []
    embedding = model.get_input_embeddings()
    embedding.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-1]))
    return seen


def outputs(actor, critic, reward, ids, mask, sp) -> dict[str, torch.Tensor]:
    kw = {"max_tokens": BUDGET, "sp": sp}
    logprobs, entropy = response_logprobs(actor, ids, mask, T, with_entropy=True, **kw)
    values = response_values(critic, ids, mask, T, **kw)
    scores = response_scores(reward, ids, mask, T, **kw)
    response = mask[:, P:].bool()
    loss = (logprobs * response).sum() + 0.1 * (entropy * response).sum()
    (loss + (values * response).sum() + scores.sum()).backward()
    out = {"logprobs": logprobs, "entropy": entropy, "values": values, "scores": scores}
    return {k: v.detach() * (response if v.dim() == 2 else 1) for k, v in out.items()}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grad = grad.clone()
        if not hasattr(param.grad, "full_tensor"):  # FSDP reduced it already
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        grads[name] = grad
    return grads


def compare(hidden: int, sharded: bool, sp) -> dict[str, float]:
    ids, mask = prompt_response_batch(PROMPTS, RESPONSES, P, T, VOCAB, seed=3)
    whole = models(hidden)
    split = [copy.deepcopy(m) for m in whole]
    if sharded:
        split = [shard_model(m, ShardingConfig()) for m in split]
    seen = [tokens_seen(whole[0]), tokens_seen(split[0])]
    want = outputs(*whole, ids, mask, NO_SP)
    got = outputs(*split, ids, mask, sp)
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    diffs["tokens_share"] = sum(seen[1]) / sum(seen[0])  # ~1/2: each rank ran half a row
    for name, a, b in zip(("actor", "critic", "reward"), split, whole, strict=True):
        ga, gb = gradients(a), {n: p.grad for n, p in b.named_parameters()}
        scale = max(float(g.abs().max()) for g in gb.values())  # relative to the largest
        diffs[f"{name}_grad"] = max(float((ga[n] - gb[n]).abs().max()) for n in gb) / scale
    return diffs


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    sp = sequence_parallel(2)
    result = {
        f"{hidden}{'_fsdp' if sharded else ''}": compare(hidden, sharded, sp)
        for hidden in (128, 64)
        for sharded in (False, True)
    }
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
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
