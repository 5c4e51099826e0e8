"""Ulysses sequence parallelism for the packed forwards (``*.ulysses_sequence_parallel_size``).

The ``sp`` ranks of a group hold the same micro-batch. Each packs it into one row as
always, pads the row to a multiple of ``8·sp`` (the padding is one more sequence, so it
attends only to itself), and runs the model on its ``1/sp`` of the row, cut zigzag so that
every rank holds as many response tokens (:class:`SequenceShard`); the packed attention
(:mod:`klppo_train.runtime.packed_attention`) gets the split in its kwargs and turns the
slice into whole sequences for ``1/sp`` of the heads and back (:class:`RowSplit`,
:func:`fsdp_sharding.ulysses.seq_to_heads`). Per-token outputs (log-probs,
entropies, values) are computed on the slice -- the ``[tokens, vocab]`` logits included,
the largest activation -- and only they are gathered over the group.

Gradients: every rank of a group computes the same loss of the whole row; the gather's
backward hands each rank its slice's gradient times ``sp``, so FSDP's mean over all
``dp × sp`` ranks is the mean over the ``dp`` replicas of the data
(:func:`fsdp_sharding.ulysses.gather_sequence`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from batching import Packing
from fsdp_sharding.ulysses import gather_sequence, heads_to_seq, repeat_kv_heads, seq_to_heads
from klppo_train.runtime.process_group import set_data_parallel

log = logging.getLogger("klppo_train")
T = TypeVar("T")
ULYSSES = "ulysses_split"
"""The model kwarg (passed down to the attention) holding a split row's :class:`RowSplit`."""


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` ranks (``1``: none), ``rank`` in it."""

    size: int = 1
    rank: int = 0
    group: Any = None


_CURRENT: tuple[Any, SequenceParallel] | None = None  # (the default group, its sp group)


def sequence_parallel(size: int) -> SequenceParallel:
    """The group of ``size`` consecutive ranks this rank belongs to; data splits, sums and
    metrics then go over the ranks at this one's place in the other groups
    (:func:`klppo_train.runtime.process_group.set_data_parallel`). A collective of the world
    when ``size > 1`` (every rank creates every group, as torch requires), the first time
    for a process group."""
    global _CURRENT
    if size == 1:
        set_data_parallel(None)  # every rank holds its own data (again, in this process)
        return SequenceParallel()
    default = dist.distributed_c10d._get_default_group()
    if _CURRENT is not None and _CURRENT[0] is default and _CURRENT[1].size == size:
        return _CURRENT[1]  # made once per process group
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide {world} ranks")
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    replicas = [dist.new_group(list(range(r, world, size))) for r in range(size)]
    set_data_parallel(replicas[rank % size], rank // size, world // size)
    if rank == 0:
        log.info(
            "Ulysses sequence parallelism: %d groups of %d ranks split each packed row; "
            "the data splits over %d replicas", world // size, size, world // size,
        )  # fmt: skip
    _CURRENT = (default, SequenceParallel(size, rank % size, groups[rank // size]))
    return _CURRENT[1]


def shared(value: T, sp: SequenceParallel) -> T:
    """The first rank of the sp group's ``value``, on every rank of the group: the group
    must train on the same samples (each rank generated its own copy; equal in principle,
    but a split row of two different samples would be silently wrong)."""
    if sp.size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(sp.group, 0), group=sp.group)
    return box[0]


@dataclass(frozen=True)
class RowSplit:
    """How a packed row is split over the sp group, for the attention (a model kwarg,
    :data:`ULYSSES`). ``order[j]``: the row position of the ``j``-th token of the ranks'
    slices concatenated in rank order; ``slot``: its inverse."""

    group: Any
    order: torch.Tensor
    slot: torch.Tensor

    def whole_sequences(self, q, k, v) -> list[torch.Tensor]:
        """This rank's slice ``[S/sp, heads, D]`` of each → every token of the row in row
        order, for this rank's share of the heads ``[S, heads/sp, D]`` (key/value heads
        repeated first when sp does not divide them)."""
        sp = dist.get_world_size(self.group)
        k, v = repeat_kv_heads(k, sp), repeat_kv_heads(v, sp)
        return [seq_to_heads(t, self.group)[self.slot] for t in (q, k, v)]

    def back_to_slice(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output ``[S, heads/sp, D]`` → this rank's slice, every head."""
        return heads_to_seq(out[self.order], self.group)


ROUNDS = 4  # zigzag rounds per row: any stretch of the row is spread to within 1/(2·sp·4)


def _zigzag(total: int, sp: int) -> torch.Tensor:
    """The row cut into ``ROUNDS`` groups of ``2·sp`` chunks; rank r's slice: chunks r and
    2·sp − 1 − r of every group. Every rank thus gets as much of any stretch of the row
    (a prompt, the responses whose logits are computed, the causal attention's longest
    rows) as the others, to within a chunk."""
    chunk = total // (2 * sp * ROUNDS)
    chunks = [g * 2 * sp + c for r in range(sp) for g in range(ROUNDS) for c in (r, 2 * sp - 1 - r)]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


class SequenceShard:
    """This rank's slice of a packed row (the whole row when ``sp.size == 1``): the row
    padded to a multiple of ``2·sp·ROUNDS`` (the padding a sequence of its own), cut
    zigzag (:func:`_zigzag`) so the ranks hold equal shares of the responses.

    ``model_kwargs()`` runs the model on the slice; ``split(positions)`` says which of the
    row's ``positions`` (a ``[K]`` index into the unpadded row) lie in the slice, as row
    positions and as slice positions; ``gather(values, local, positions)`` turns values
    computed at this rank's share of ``positions`` back into ``[K]`` values at all of them."""

    def __init__(self, packing: Packing, sp: SequenceParallel) -> None:
        if sp.size > 1 and packing.layout is not None:
            raise ValueError("sequence parallelism does not run shared-prompt packings")
        self.packing, self.sp = packing, sp
        self.nnz = packing.input_ids.shape[1]
        self.pad = -self.nnz % (2 * sp.size * ROUNDS) if sp.size > 1 else 0
        total = self.nnz + self.pad
        self.length = total // sp.size  # tokens of each rank's slice
        self.start = sp.rank * self.length
        device = packing.input_ids.device
        self.order = _zigzag(total, sp.size).to(device) if sp.size > 1 else None
        self.slot = None if self.order is None else torch.argsort(self.order)

    def model_kwargs(self) -> dict[str, Any]:
        if self.sp.size == 1:
            return self.packing.model_kwargs()
        p, device = self.packing, self.packing.input_ids.device
        ids = torch.cat([p.input_ids, p.input_ids.new_zeros(1, self.pad)], dim=1)
        tail = torch.arange(self.pad, device=device, dtype=p.position_ids.dtype)
        positions = torch.cat([p.position_ids, tail[None]], dim=1)
        cu = p.cu_seqlens
        if self.pad:  # the padding as a sequence of its own
            cu = torch.cat([cu, cu.new_tensor([self.nnz + self.pad])])
        mine = self.order[self.start : self.start + self.length]
        return {
            "input_ids": ids[:, mine],
            "position_ids": positions[:, mine],
            "attention_mask": None,
            "use_cache": False,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(p.max_seqlen, self.pad),
            "max_length_k": max(p.max_seqlen, self.pad),
            ULYSSES: RowSplit(self.sp.group, self.order, self.slot),
        }

    def split(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row positions, slice positions)`` of the ``positions`` in this rank's slice,
        in the order of ``positions``."""
        if self.sp.size == 1:
            return positions, positions
        slots = self.slot[positions]
        here = (slots >= self.start) & (slots < self.start + self.length)
        return positions[here], slots[here] - self.start

    def gather(
        self, values: torch.Tensor, local: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``values`` ``[k]`` at this rank's share of ``positions`` (at slice positions
        ``local``: :meth:`split`'s) → ``[K]`` at all of them (differentiable:
        :func:`fsdp_sharding.ulysses.gather_sequence`)."""
        if self.sp.size == 1:
            return values
        chunk = values.new_zeros(self.length).index_put((local,), values)
        return gather_sequence(chunk, self.sp.group, dim=0)[self.slot[positions]]
