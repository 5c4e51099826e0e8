"""Run under `torchrun --nproc-per-node=2`: train a tiny model 3 AdamW steps unsharded (on the
full batch) and sharded (each rank half the batch) for every variant; rank 0 writes
<out>/parity.json with losses, parameter differences, grad norms and prefetch lists."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import batch, tiny_llama, tiny_qwen2
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fsdp_sharding import ShardingConfig, clip_grad_norm, iter_full_state_dict, shard_model

STEPS, LR = 3, 1e-2
VARIANTS = {
    "default": {},
    "forward_prefetch": {"forward_prefetch": True},
    "forward_prefetch_depth2": {"forward_prefetch": 2},
    "no_backward_prefetch": {"backward_prefetch": False},
    "reshard_off": {"reshard_after_forward": False},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "activation_offload": {"activation_offload": True},
    "offload_policy": {"offload_policy": True},
    "hybrid_shard": {"fsdp_size": 1},  # 2-D mesh: replicate 2 x shard 1
}
MODELS = {"qwen2_untied": lambda: tiny_qwen2(tie=False), "llama_tied": tiny_llama}


def train(model, rows, shard: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        norms.append(float(clip_grad_norm(model, max_norm=1e9)))
        optimizer.step()
        optimizer.zero_grad()
        if shard:
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss.detach()))
    return losses, norms


def prefetch_lists(model):
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state") and m is not model]
    return [
        [
            len(u._get_fsdp_state()._states_to_forward_prefetch),
            len(u._get_fsdp_state()._states_to_backward_prefetch),
        ]
        for u in units
    ]


def applied(model, strategy):
    """What the sharded model actually carries (so a silently dropped lever shows up)."""
    wrapped = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    if strategy == "fsdp1":
        return {"checkpoint_wrappers": wrapped, "strategy": str(model.sharding_strategy)}
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state") and m is not model]
    keeps = [u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None for u in units]
    return {"checkpoint_wrappers": wrapped, "keeps_params_after_forward": keeps}


def run_variant(make_model, strategy, overrides, rank):
    full = batch()
    ref_model = make_model()
    ref_losses, ref_norms = train(ref_model, full, shard=False)
    reference = {n: p.detach() for n, p in ref_model.named_parameters()}
    model = shard_model(make_model(), ShardingConfig(strategy=strategy, **overrides))
    initial = {n: t.clone() for n, t in iter_full_state_dict(model)}
    fresh = dict(make_model().named_parameters())
    init_exact = initial.keys() == fresh.keys() and all(
        torch.equal(initial[n], fresh[n].detach()) for n in fresh
    )
    losses, norms = train(model, full[2 * rank : 2 * rank + 2], shard=True)
    final = dict(iter_full_state_dict(model))
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": max((final[n] - reference[n]).abs().max().item() for n in reference),
        "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms, strict=True)),
        "names_match": sorted(final) == sorted(reference),
        "init_stream_exact": init_exact,
        "losses": losses,
        "prefetch": prefetch_lists(model) if strategy == "fsdp2" else None,
        "applied": applied(model, strategy),
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for model_name, make_model in MODELS.items():
        for strategy in ("fsdp2", "fsdp1"):
            for name, overrides in VARIANTS.items():
                if strategy == "fsdp1" and (
                    "offload_policy" in overrides
                    or isinstance(overrides.get("forward_prefetch"), int)
                    and overrides["forward_prefetch"] is not True
                ):
                    continue
                key = f"{model_name}/{strategy}/{name}"
                results[key] = run_variant(make_model, strategy, overrides, rank)
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
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
