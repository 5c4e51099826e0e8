"""Ulysses sequence parallelism for the packed forwards (``*.ulysses_sequence_parallel_size``).

The ``sp`` ranks of a group hold the same micro-batch. Each packs it into one row as
always, pads the row to a multiple of ``sp`` (the padding is one more sequence, so it
attends only to itself), and runs the model on its ``1/sp`` slice of the row
(:class:`SequenceShard`); the packed attention (:mod:`klppo_train.runtime.packed_attention`)
sees the group in its kwargs and turns the slice into whole sequences for ``1/sp`` of the
heads and back (:func:`fsdp_sharding.ulysses.seq_to_heads`). Per-token outputs (log-probs,
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
from klppo_train.runtime.process_group import set_data_parallel

log = logging.getLogger("klppo_train")
T = TypeVar("T")
ULYSSES_GROUP = "ulysses_group"
"""The model kwarg (passed down to the attention) holding the sequence-parallel group."""


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


class SequenceShard:
    """This rank's slice of a packed row (the whole row when ``sp.size == 1``).

    ``model_kwargs()`` runs the model on the slice; ``split(positions)`` says which of the
    row's ``positions`` (a ``[K]`` index into the unpadded row) lie in the slice, as row
    positions and as slice positions; ``gather(values, positions)`` turns values computed
    at this rank's share of ``positions`` back into ``[K]`` values at all of them."""

    def __init__(self, packing: Packing, sp: SequenceParallel) -> None:
        if sp.size > 1 and packing.layout is not None:
            raise ValueError("sequence parallelism does not run shared-prompt packings")
        self.packing, self.sp = packing, sp
        self.nnz = packing.input_ids.shape[1]
        self.pad = -self.nnz % sp.size
        self.length = (self.nnz + self.pad) // sp.size  # tokens of each rank's slice
        self.start = sp.rank * self.length

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
        end = self.start + self.length
        return {
            "input_ids": ids[:, self.start : end],
            "position_ids": positions[:, self.start : end],
            "attention_mask": None,
            "use_cache": False,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(p.max_seqlen, self.pad),
            "max_length_k": max(p.max_seqlen, self.pad),
            ULYSSES_GROUP: self.sp.group,
        }

    def split(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row positions, slice positions)`` of the ``positions`` in this rank's slice."""
        if self.sp.size == 1:
            return positions, positions
        mine = positions[(positions >= self.start) & (positions < self.start + self.length)]
        return mine, mine - self.start

    def gather(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``values`` ``[k]`` at this rank's share of ``positions`` → ``[K]`` at all of them
        (differentiable: :func:`fsdp_sharding.ulysses.gather_sequence`)."""
        if self.sp.size == 1:
            return values
        from fsdp_sharding.ulysses import gather_sequence

        _, local = self.split(positions)
        chunk = values.new_zeros(self.length).index_put((local,), values)
        return gather_sequence(chunk, self.sp.group, dim=0)[positions]
