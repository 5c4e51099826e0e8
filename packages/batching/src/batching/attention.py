"""Causal attention over packed sequences at a cost linear in the sequences' own lengths.

A packed micro-batch is one ``[1, nnz]`` row of several sequences. Attention must stay
inside each sequence. transformers' default for a packed row (``sdpa`` with restarting
``position_ids``) builds a dense block-diagonal ``[nnz, nnz]`` mask: attention then costs
``nnz²`` time and memory instead of ``Σ Lᵢ²``, and grows with the token budget.

:func:`varlen_causal_attention` takes the flash-attn varlen layout (``cu_seqlens``) and
runs ``scaled_dot_product_attention(is_causal=True)`` on *groups of sequences of similar
length*, each group gathered into a right-padded ``[G, H, L_max, D]`` block. With right
padding a causal query never sees a padded key, so no mask is needed and sdpa takes its
fused (flash) kernel on CPU and GPU; padded query rows are computed and dropped. Grouping
bounds the padding: a group's longest sequence is at most ``ratio`` times its
shortest. The result is exact (the same arithmetic as a padded forward).

Which packed-attention path to use (SmolLM2-135M backbone forward, no grad, 2 CPU threads,
torch 2.13.0+cpu, transformers 5.19; sequences of 40–70 tokens, ~20 % padding when padded;
``benchmarks/ppo_step_bench.py`` measures it again)
-----------------------------------------------------------------------------------------
Intel Xeon with AMX-BF16 (matmul peak fp32 431, bf16 2709 GFLOP/s), 2026-12-01:

=====================================  ========  ========  ========  ========  ========
seconds per forward                    fp32 1k   fp32 4k   fp32 16k  bf16 4k   bf16 16k
=====================================  ========  ========  ========  ========  ========
packed, :func:`varlen_causal_attention` 0.77      3.21      16.0      0.93      6.32
padded to the longest, attention mask  0.88      4.18      21.2      1.11      5.92
packed, HF dense ``[nnz, nnz]`` mask   0.97      7.86      (~9 GB)   2.53      (~9 GB)
=====================================  ========  ========  ========  ========  ========

Per token the packed path costs 0.76 / 0.78 / 0.98 ms (fp32, 1k / 4k / 16k) and 0.28 / 0.23 /
0.39 ms (bf16): the attention work is linear, the growth at 16k is the rest of the model
(activations falling out of cache), which the padded forward shows as well. An AMD EPYC with
AVX512-BF16 (``../shared/notes/cpu-speed.md``, 58 sequences, 3216 tokens) gave: dense mask
9.08 s fp32 / 5.58 s bf16, padded 6.29 / 2.04 s. ``flash_attention_2`` (flash-attn's own
varlen kernel) stays the GPU path where it is installed; it reads the same ``cu_seqlens``.

Each group runs through sdpa (:func:`sdpa_causal_attention`) unless the caller passes a
``group_attention``: the trainer's ``model.compile`` passes a compiled
:func:`matmul_causal_attention` for short bf16 groups on CPU, where sdpa's kernel is far from
the matmul peak (64 sequences × 110 tokens, SmolLM2's 9/3 heads, AMD EPYC, 2 threads:
no-grad forward 9.7 ms vs 20.2 bf16 sdpa; forward + backward 34.8 ms vs 67.1 for sdpa in
fp32, the bf16 training path).

A layout may also give sequences packed tokens in common (:func:`sequence_layout`, used by
:func:`batching.pack_shared_prompts`: the ``n`` samples of a prompt attend over one packed
copy of its prefix). Attention work is unchanged (each sequence still attends over its full
length); what shrinks is every other layer's, by the prompt tokens that are not repeated.
AMD EPYC with AVX512-BF16 (matmul peak bf16 692 GFLOP/s), 2026-12-02, a whole SmolLM2 PPO
step of 16 prompts × 4 samples × ≤ 64 tokens in bf16 (``ppo_step_bench.py``): 48.7 s with
one prompt copy per sample, 35.3 s shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GroupAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""Causal attention of one right-padded group: ``(q [G, H, L, D], k [G, H_kv, L, D], v,
scale) -> [G, H, L, D]``."""

DEFAULT_GROUP_RATIO = 1.25
"""Longest ÷ shortest sequence in one attention group: padding wastes at most
``1 - 1/ratio²`` of a group's attention work (36 % at 1.25), and only in attention."""


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together as one right-padded block.

    Attributes:
        gather: ``[G, L]`` int64 packed-token index of each slot; padding slots repeat the
            sequence's first token (never attended to: they come after every valid key). A
            token shared by several sequences (a common prompt prefix) fills a slot of each.
        valid_slots: ``[n_valid]`` int64 flat indices, in ``[G * L]``, of the slots whose
            output is kept: a real token, in the one sequence that owns it.
    """

    gather: torch.Tensor
    valid_slots: torch.Tensor


@dataclass(frozen=True)
class VarlenLayout:
    """How a packed row splits into attention groups (computed once per forward).

    Attributes:
        groups: the groups, longest sequences first.
        inverse: ``[nnz]`` int64: packed token ``t`` is row ``inverse[t]`` of the groups'
            valid outputs concatenated in group order.
        nnz: packed tokens.
    """

    groups: tuple[AttentionGroup, ...]
    inverse: torch.Tensor
    nnz: int

    def to(self, device: torch.device | str) -> VarlenLayout:
        """A copy with every index tensor on ``device``."""
        groups = tuple(
            AttentionGroup(g.gather.to(device), g.valid_slots.to(device)) for g in self.groups
        )
        return VarlenLayout(groups=groups, inverse=self.inverse.to(device), nnz=self.nnz)


def group_by_length(seq_lens: list[int], ratio: float) -> list[list[int]]:
    """Sequence indices (non-empty ones) in groups, longest first, where each group's
    longest sequence is at most ``ratio`` times its shortest."""
    if ratio < 1:
        raise ValueError(f"`ratio` must be >= 1, got {ratio}")
    order = sorted((i for i, n in enumerate(seq_lens) if n > 0), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and seq_lens[groups[-1][0]] <= ratio * seq_lens[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def varlen_layout(cu_seqlens: torch.Tensor, ratio: float = DEFAULT_GROUP_RATIO) -> VarlenLayout:
    """The :class:`VarlenLayout` of a packed row from its ``[B + 1]`` ``cu_seqlens``.

    Reads ``cu_seqlens`` on the host once (a device sync on GPU); index tensors are made on
    ``cu_seqlens``' device.
    """
    starts = cu_seqlens.tolist()
    device = cu_seqlens.device
    bounds = zip(starts[:-1], starts[1:], strict=True)
    tokens = [torch.arange(a, b, device=device) for a, b in bounds]
    return sequence_layout(tokens, [0] * len(tokens), starts[-1] - starts[0], ratio)


def sequence_layout(
    tokens: list[torch.Tensor],
    shared: list[int],
    nnz: int,
    ratio: float = DEFAULT_GROUP_RATIO,
) -> VarlenLayout:
    """The :class:`VarlenLayout` of sequences given as the packed tokens each attends over.

    Sequences may share packed tokens (a common prompt prefix run once,
    :func:`batching.pack_shared_prompts`): sequence ``b`` attends over ``tokens[b]`` in
    order, and its first ``shared[b]`` slots are owned by another sequence, which alone
    gives their output. Every packed token must be owned by exactly one slot.

    Args:
        tokens: per sequence, ``[L_b]`` int64 packed-token indices, all on one device.
        shared: per sequence, how many leading slots it does not own.
        nnz: packed tokens in the row.
        ratio: longest ÷ shortest sequence in one attention group.
    """
    lens = [int(t.shape[0]) for t in tokens]
    groups, pieces = [], []
    for members in group_by_length(lens, ratio):
        length = torch.tensor([lens[i] for i in members])
        offset = torch.arange(lens[members[0]])
        valid = offset[None, :] < length[:, None]
        owned = valid & (offset[None, :] >= torch.tensor([shared[i] for i in members])[:, None])
        # Padding slots repeat the sequence's first token (never attended: see AttentionGroup).
        gather = torch.nn.utils.rnn.pad_sequence([tokens[i] for i in members], batch_first=True)
        first = gather[:, :1].expand_as(gather)
        gather = torch.where(valid.to(gather.device), gather, first)
        slots = owned.reshape(-1).nonzero().squeeze(-1).to(gather.device)
        groups.append(AttentionGroup(gather=gather, valid_slots=slots))
        pieces.append(gather.reshape(-1)[slots])
    device = tokens[0].device if tokens else torch.device("cpu")
    inverse = torch.zeros(nnz, dtype=torch.long, device=device)
    if pieces:
        order = torch.cat(pieces)  # group-order row -> packed token
        if order.shape[0] != nnz:
            raise ValueError(f"{order.shape[0]} owned slots for {nnz} packed tokens")
        inverse[order] = torch.arange(nnz, device=device)
    return VarlenLayout(groups=tuple(groups), inverse=inverse, nnz=nnz)


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: VarlenLayout,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    group_attention: GroupAttention | None = None,
) -> torch.Tensor:
    """Causal self-attention of every packed sequence with itself only (with its own tokens
    and, in a :func:`sequence_layout`, the tokens it shares with others, e.g. a prompt).

    For each sequence ``s`` and query position ``i``:
    ``out[i] = softmax(scale · q_i Kₛ[:i+1]ᵀ) Vₛ[:i+1]``.

    Args:
        query: ``[nnz, H, D]`` packed queries (flash-attn varlen layout).
        key: ``[nnz, H_kv, D]``; ``H`` must be a multiple of ``H_kv`` (grouped-query
            attention shares each key/value head among ``H / H_kv`` query heads).
        value: ``[nnz, H_kv, D]``.
        layout: from :func:`varlen_layout` for the row's ``cu_seqlens``, or
            :func:`sequence_layout` (``Packing.layout`` of a shared-prompt packing).
        scale: softmax scale; default ``1 / sqrt(D)``.
        dropout_p: attention dropout (training only).
        group_attention: attends each group instead of :func:`sdpa_causal_attention` (e.g. a
            compiled :func:`matmul_causal_attention`); not used with dropout.

    Returns:
        ``[nnz, H, D]`` in the dtype of ``query``; differentiable in all three inputs.
    """
    if query.shape[0] != layout.nnz:
        raise ValueError(f"`query` has {query.shape[0]} tokens but the layout {layout.nnz}")
    if not layout.groups:
        return query.new_zeros(query.shape)
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    outputs = []
    for group in layout.groups:
        # index_select, not t[gather]: its backward is an index_add (advanced indexing's is a
        # sort-based accumulate, 2-3x slower on CPU). [G*L, H, D] -> [G, H, L, D]
        index = group.gather.reshape(-1)
        q, k, v = (
            t.index_select(0, index).view(*group.gather.shape, *t.shape[1:]).transpose(1, 2)
            for t in (query, key, value)
        )
        if group_attention is None or dropout_p:
            out = sdpa_causal_attention(q, k, v, scale, dropout_p)
        else:
            out = group_attention(q, k, v, scale)
        heads, dim = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(index.shape[0], heads, dim)  # [G*L, H, D]
        outputs.append(out.index_select(0, group.valid_slots).to(query.dtype))  # [n_valid, H, D]
    return torch.cat(outputs).index_select(0, layout.inverse)


def sdpa_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal sdpa of one right-padded group (the default :data:`GroupAttention`):
    ``[G, H, L, D]`` queries, ``[G, H_kv, L, D]`` keys/values → ``[G, H, L, D]``."""
    # sdpa's own grouped-query path: 1.2-1.6x faster on CPU than repeating K/V heads.
    gqa = q.shape[1] != k.shape[1]
    # CPU sdpa's bf16 *backward* is slow (SmolLM2 shapes, 2 threads: 50 ms per layer vs 18 ms
    # in fp32; its bf16 forward is fast), so a bf16 training forward attends in fp32.
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad:
        q, k, v = q.float(), k.float(), v.float()
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
    )


def matmul_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one right-padded group as two matmuls in the inputs' dtype around
    an fp32 softmax (transformers' ``eager`` arithmetic, without repeating K/V heads):
    ``out = softmax(scale · Q Kᵀ + causal) V``, scores ``[G, H, L, L]``.

    Meant to be ``torch.compile``d for short bf16 groups on CPU, where inductor fuses the
    mask, scale, softmax and casts: SmolLM2 shapes (64 sequences × 110 tokens, 9 heads, 3 K/V
    heads), 2 threads, bf16: forward 9.7 ms vs sdpa's 20.2, forward + backward 34.8 ms vs
    67.1 for sdpa in fp32 (the training path above); max error against float64 0.021 vs
    0.016 (output), 0.03-0.04 vs 0.02-0.04 (gradients). Eager it is slower than sdpa in
    training. Scores cost ``G·H·L²`` memory, so it is for short sequences only.

    Args:
        q: ``[G, H, L, D]``; query head ``h`` reads K/V head ``h // (H / H_kv)``.
        k: ``[G, H_kv, L, D]``.
        v: ``[G, H_kv, L, D]``.
        scale: softmax scale.
    """
    groups, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    # The H / H_kv query heads of one K/V head as one longer query block: no K/V copies.
    q = q.reshape(groups, kv_heads, (heads // kv_heads) * length, dim)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64
    scores = torch.matmul(q, k.transpose(-1, -2)).to(softmax_dtype)
    scores = scores.view(groups, kv_heads, heads // kv_heads, length, length)
    i = torch.arange(length, device=q.device)
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf")) * scale
    probs = scores.softmax(-1).to(v.dtype).view(groups, kv_heads, -1, length)
    return torch.matmul(probs, v).view(groups, heads, length, dim)
