"""Run under `torchrun --nproc-per-node=2` as `ulysses_worker.py <out.json>`: causal attention
over a packed row of uneven sequences (17 tokens: not a multiple of 2), once whole on every
rank and once split over the two ranks with Ulysses' all-to-alls; records the largest
differences of the outputs and of the gradients of q, k and v (GQA and repeated KV heads
included)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_sharding.ulysses import (
    gather_sequence,
    heads_to_seq,
    pad_to_multiple,
    repeat_kv_heads,
    seq_to_heads,
    sequence_slice,
    ulysses_mesh,
)

LENGTHS = (5, 8, 4)
D = 8


def attention(q, k, v, lengths) -> torch.Tensor:
    """The reference: each sequence causally with itself, ``[S, H, D]`` (GQA by repeat)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out, start = [], 0
    for length in lengths:
        part = [t[start : start + length].transpose(0, 1) for t in (q, k, v)]
        out.append(F.scaled_dot_product_attention(*part, is_causal=True).transpose(0, 1))
        start += length
    return torch.cat(out)


def case(heads: int, kv_heads: int, group) -> dict:
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, D, generator=gen) for h in (heads, kv_heads, kv_heads))
    weight = torch.randn(total, heads, D, generator=gen)  # the loss: (out * weight).sum()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(*full, LENGTHS)
    (expected * weight).sum().backward()

    # Split: pad to a multiple of sp (the pad is a sequence of its own), take this rank's
    # slice, attend whole sequences for this rank's heads, turn back, gather.
    padded = [pad_to_multiple(t, sp, dim=0)[0] for t in (q, k, v)]
    pad = padded[0].shape[0] - total
    mine = [sequence_slice(t, sp, rank, dim=0).clone().requires_grad_() for t in padded]
    kv = [seq_to_heads(repeat_kv_heads(t, sp), group) for t in mine[1:]]
    local = attention(seq_to_heads(mine[0], group), *kv, (*LENGTHS, pad) if pad else LENGTHS)
    out = gather_sequence(heads_to_seq(local, group), group, dim=0, grad_scale=1.0)[:total]
    (out * weight).sum().backward()
    diffs = {"out": float((out - expected).abs().max())}
    for name, split, whole in zip("qkv", mine, full, strict=True):
        grad = sequence_slice(pad_to_multiple(whole.grad, sp, dim=0)[0], sp, rank, dim=0)
        diffs[f"grad_{name}"] = float((split.grad - grad).abs().max())
    return diffs


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    group = ulysses_mesh(2, torch.device("cpu"))["sp"].get_group()  # dp 1 × sp 2
    found = {f"{h}x{kv}": case(h, kv, group) for h, kv in ((4, 4), (4, 2), (4, 1))}
    gathered = [None, None]
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Skip interpreter teardown (as ckpt_worker/stream_worker do): gloo aborted a rank in
    # finalization, after every result was written ("terminate called without an active
    # exception", no Python frame; dp_forward_worker in CI, 2026-12-07).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
