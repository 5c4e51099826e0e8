"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl runs it with FSDP): the tokens of a
packed row are split over the ``sp`` ranks of a group; every layer but attention works on
this rank's slice as it is (embeddings, norms, MLPs are per token), and attention turns the
slice into whole sequences for a share of the heads with one all-to-all, attends, and turns
the result back with a second:

    [S/sp, H, D]  --seq_to_heads-->  [S, H/sp, D]  --attention-->  --heads_to_seq-->  [S/sp, H, D]

so a rank holds 1/sp of every activation outside attention. ``S`` is the packed row's
length padded to a multiple of ``sp`` (:func:`pad_to_multiple`, :func:`sequence_slice`); the
outputs come back whole with :func:`gather_sequence`.

Every collective is ``all_to_all_single`` / ``all_gather_single`` (gloo runs both;
gloo lacks the list form ``all_to_all`` verl uses), wrapped in an autograd function whose
backward is the opposite collective, so gradients flow to every rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def ulysses_mesh(sp: int, device: torch.device) -> DeviceMesh:
    """The ``(dp, sp)`` mesh of the world: consecutive groups of ``sp`` ranks share their data
    and split its sequences (``mesh["sp"].get_group()`` for the all-to-alls); the ``dp``
    groups hold different data. ``sp`` must divide the world size."""
    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} does not divide the world size {world}"
        )
    return init_device_mesh(device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))


def pad_to_multiple(row: torch.Tensor, sp: int, value: int | float = 0, dim: int = -1):
    """``(row padded along dim to a multiple of sp with value, the number of pad entries)``."""
    pad = -row.shape[dim] % sp
    if pad == 0:
        return row, 0
    shape = list(row.shape)
    shape[dim] = pad
    filler = torch.full(shape, value, dtype=row.dtype, device=row.device)
    return torch.cat([row, filler], dim=dim), pad


def sequence_slice(row: torch.Tensor, sp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1/sp`` of ``row`` along ``dim`` (its length a multiple of
    ``sp``: :func:`pad_to_multiple`)."""
    size = row.shape[dim] // sp
    return row.narrow(dim, rank * size, size)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (block j goes to rank j; block r of the result came
    from rank r)."""
    x = x.contiguous()  # before empty_like: it copies a transposed view's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    # [S/n, H, D] → [n, S/n, H/n, D] (block j: heads of rank j) → exchange → [S, H/n, D]
    n = dist.get_world_size(group)
    s, h, d = x.shape
    blocks = x.reshape(s, n, h // n, d).transpose(0, 1)
    return _all_to_all(blocks, group).reshape(n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    # [S, H/n, D] → [n, S/n, H/n, D] (block j: rank j's tokens) → exchange → [S/n, H, D]
    n = dist.get_world_size(group)
    s, h, d = x.shape
    received = _all_to_all(x.reshape(n, s // n, h, d), group)
    return received.transpose(0, 1).reshape(s // n, n * h, d)


class _Exchange(Function):
    """One of the two all-to-alls; its backward is the other one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[S/sp, H, D]`` (this rank's tokens, every head) → ``[S, H/sp, D]`` (every token, this
    rank's heads: ``H/sp`` consecutive ones, rank r's from ``r·H/sp``). ``H`` must be a
    multiple of the group's size (repeat key/value heads first: :func:`repeat_kv_heads`).
    Differentiable; a collective of ``group`` (default: the world)."""
    n = dist.get_world_size(group)
    if x.shape[1] % n:
        raise ValueError(f"{x.shape[1]} heads do not split over {n} sequence-parallel ranks")
    return _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[S, H/sp, D]`` → ``[S/sp, H, D]``."""
    return _Exchange.apply(x, group, False)


def repeat_kv_heads(x: torch.Tensor, sp: int) -> torch.Tensor:
    """Key/value heads ``[S, H_kv, D]`` repeated so that ``sp`` divides them when it does not
    (``sp > H_kv``: each head ``sp / H_kv`` times, in place, so rank r's share of the
    repeated heads serves its share of the query heads, as in grouped-query attention)."""
    h_kv = x.shape[1]
    if h_kv % sp == 0:
        return x
    if sp % h_kv:
        raise ValueError(f"{h_kv} key/value heads cannot be shared by {sp} ranks")
    return x.repeat_interleave(sp // h_kv, dim=1)


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.grad_scale = group, dim, grad_scale
        n = dist.get_world_size(group)
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        mine = sequence_slice(grad, n, rank, ctx.dim) * ctx.grad_scale
        return mine, None, None, None


def gather_sequence(
    x: torch.Tensor, group=None, dim: int = 0, grad_scale: float | None = None
) -> torch.Tensor:
    """Every rank's slice of the sequence, concatenated along ``dim`` in rank order (the
    whole padded row on every rank of ``group``). Backward: this rank's slice of the
    gradient times ``grad_scale`` (default the group's size: every rank then computes the
    same loss of the whole row, and data parallelism's mean over the ``dp × sp`` ranks divides
    by ``sp`` once more than the ``dp`` replicas of the data)."""
    n = dist.get_world_size(group)
    return _GatherSequence.apply(x, group, dim, float(n if grad_scale is None else grad_scale))
