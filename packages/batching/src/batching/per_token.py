"""Per-response-token outputs of a model over a verl batch: micro-batched, packed, back in
input order.

The layout is verl's: ``input_ids`` ``[B, P + T]`` = left-padded prompts ``[B, P]`` followed
by right-padded responses ``[B, T]``, with one ``attention_mask``. :func:`per_response_token`
splits the batch into micro-batches (a token budget, :func:`token_budget_micro_batches`, or
verl's static mode of a fixed number of sequences), packs each into one row without padding
(:func:`pack`), lets ``compute`` produce per-token outputs at the packed positions that
predict a response token, and returns them ``[B, T]`` in the input order. What ``compute``
is (log-probs from an LM, values from a value head) is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batching.distributed import sync_num_micro_batches
from batching.micro_batches import (
    MicroBatchPlan,
    fixed_size_micro_batches,
    restore_order,
    token_budget_micro_batches,
)
from batching.packing import Packing, pack
from batching.prompt_sharing import (
    PromptPrefixes,
    pack_shared_prompts,
    prompt_prefixes,
    shared_prompt_plan,
)

# compute(model, packing, keep) -> per-token outputs at the packed positions ``keep`` [K]
PackedFn = Callable[[nn.Module, Packing, torch.Tensor], tuple[torch.Tensor, ...]]


def _padded(values: torch.Tensor, keep: torch.Tensor, packing: Packing) -> torch.Tensor:
    """``[K]`` values at packed positions ``keep`` → ``[B, S]`` (zeros elsewhere;
    differentiable): one scatter straight into the padded layout."""
    out = values.new_zeros(packing.batch_size * packing.seq_len)
    out = out.index_put((packing.indices[keep],), values)
    return out.view(packing.batch_size, packing.seq_len)


def micro_batch_plan(
    lengths: torch.Tensor,
    max_tokens: int,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
    *,
    sync_ranks: bool = False,
    group=None,
    prefixes: PromptPrefixes | None = None,
) -> MicroBatchPlan:
    """Token-budget micro-batches (``use_dynamic_bsz``), or with ``micro_batch_size`` fixed
    ones of that many sequences (verl's static mode; the budget is then not used).

    ``sync_ranks``: every rank of ``group`` (default: the world, when a process group is
    initialized) gets the same number of budget micro-batches -- the largest any rank's own
    plan needs (:func:`~batching.sync_num_micro_batches`) -- as FSDP needs: each
    micro-batch's forward is a collective. All ranks must then call it. A given
    ``num_micro_batches`` is taken as already agreed (no collective), and fixed-size plans
    are equal already when the ranks hold equal numbers of sequences.

    ``prefixes`` (:func:`~batching.prompt_prefixes`): budget micro-batches for
    :func:`~batching.pack_shared_prompts`, a prompt's sequences kept together and the
    budget counting each shared prefix once (:func:`~batching.shared_prompt_plan`).
    """
    if micro_batch_size is not None:
        return fixed_size_micro_batches(lengths, micro_batch_size)

    def plan(count: int | None) -> MicroBatchPlan:
        if prefixes is None:
            return token_budget_micro_batches(lengths, max_tokens, num_micro_batches=count)
        return shared_prompt_plan(lengths, prefixes, max_tokens, num_micro_batches=count)

    if sync_ranks and num_micro_batches is None:
        num_micro_batches = sync_num_micro_batches(len(plan(None)), group)
    return plan(num_micro_batches)


def per_response_token(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    compute: PackedFn,
    *,
    max_tokens: int,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
    sync_ranks: bool = True,
    group=None,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """Run ``compute`` per micro-batch; return each output as ``[B, T]``: the value at the
    position *before* each response token (the one that predicts it), in the input order.

    Under torch.distributed every rank of ``group`` runs the same number of micro-batches
    (``sync_ranks``, on by default: a sharded model's forward is a collective); pass
    ``sync_ranks=False`` for a model that only this rank runs.

    ``share_prompts``: sequences with the same prompt run its tokens once per micro-batch
    (:func:`~batching.pack_shared_prompts`; the model's attention must read
    ``Packing.layout``), and ``max_tokens`` counts the tokens that run."""
    lengths = attention_mask.sum(-1)
    prompt_length = input_ids.shape[1] - response_length
    prefixes = prompt_prefixes(input_ids, attention_mask, prompt_length) if share_prompts else None
    plan = micro_batch_plan(
        lengths,
        max_tokens,
        micro_batch_size,
        num_micro_batches,
        sync_ranks=sync_ranks,
        group=group,
        prefixes=prefixes,
    )
    outputs = [
        run_micro_batch(
            model,
            input_ids[rows],
            attention_mask[rows],
            response_length,
            compute,
            share_prompts=share_prompts,
        )
        for rows in (torch.tensor(m, device=input_ids.device) for m in plan.micro_batches)
    ]
    return [restore_order([o[k] for o in outputs], plan) for k in range(len(outputs[0]))]


def run_micro_batch(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    compute: PackedFn,
    *,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """``compute`` over one micro-batch that is already planned -- every row of
    ``input_ids`` ``[b, P + T]``, packed into one row -- with each output ``[b, T]`` in the
    rows' order: the value at the position *before* each response token. No plan and no
    collective: for a caller (an update) that cut its micro-batches and agreed their count
    over the ranks itself (:func:`micro_batch_plan`). ``share_prompts``: as in
    :func:`per_response_token`."""
    prompt_length = input_ids.shape[1] - response_length
    if share_prompts:
        packing = pack_shared_prompts(input_ids, attention_mask, prompt_length)
    else:
        packing = pack(input_ids, attention_mask)
    # Position s predicts token s + 1: responses start at column P, so their values sit at
    # columns P - 1 .. P + T - 2.
    start = prompt_length - 1
    column = packing.indices % packing.seq_len
    keep = ((column >= start) & (column < start + response_length)).nonzero().squeeze(-1)
    return [
        _padded(t, keep, packing)[:, start : start + response_length]
        for t in compute(model, packing, keep)
    ]
