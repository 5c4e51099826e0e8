"""Per-token log-probs of responses: token-budget micro-batches, packed, in input order.

The layout is verl's: ``input_ids`` ``[B, P + T]`` = left-padded prompts ``[B, P]`` followed
by right-padded responses ``[B, T]``, with one ``attention_mask``. Each micro-batch (at most
``max_tokens`` valid tokens, :func:`batching.token_budget_micro_batches`) is packed into one
row without padding (:func:`batching.pack`), whose attention stays inside each sequence
(:mod:`klppo_train.attention`: ``klppo_varlen``, linear in Σ Lᵢ²), and the results come back
``[B, T]`` in the input order. Only the positions that predict a response token get logits
(``logits_to_keep``: the prompt's ~half of the ``[tokens, vocab]`` head is never computed).
Actor, reference and (with a value head instead of log-probs) critic all use this path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batching import (
    MicroBatchPlan,
    Packing,
    fixed_size_micro_batches,
    next_token_labels,
    pack,
    restore_order,
    token_budget_micro_batches,
)
from ppo_core import logprobs_and_entropy

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
) -> MicroBatchPlan:
    """Token-budget micro-batches (``use_dynamic_bsz``), or with ``micro_batch_size`` fixed
    ones of that many sequences (verl's static mode; the budget is then not used)."""
    if micro_batch_size is not None:
        return fixed_size_micro_batches(lengths, micro_batch_size)
    return token_budget_micro_batches(lengths, max_tokens, num_micro_batches=num_micro_batches)


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
) -> list[torch.Tensor]:
    """Run ``compute`` per micro-batch; return each output as ``[B, T]``: the value at the
    position *before* each response token (the one that predicts it), in the input order."""
    lengths = attention_mask.sum(-1)
    plan = micro_batch_plan(lengths, max_tokens, micro_batch_size, num_micro_batches)
    # Position s predicts token s + 1: responses start at column P, so their values sit at
    # columns P - 1 .. P + T - 2.
    start = input_ids.shape[1] - response_length - 1
    outputs: list[list[torch.Tensor]] = []
    for members in plan.micro_batches:
        rows = torch.tensor(members, device=input_ids.device)
        packing = pack(input_ids[rows], attention_mask[rows])
        column = packing.indices % packing.seq_len
        keep = ((column >= start) & (column < start + response_length)).nonzero().squeeze(-1)
        outputs.append([_padded(t, keep, packing) for t in compute(model, packing, keep)])
    return [
        restore_order([o[k] for o in outputs], plan)[:, start : start + response_length]
        for k in range(len(outputs[0]))
    ]


def _logprobs_fn(temperature: float, with_entropy: bool) -> PackedFn:
    def compute(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = model(**packing.model_kwargs(), logits_to_keep=keep).logits[0]  # [K, V]
        labels, _ = next_token_labels(packing)
        logprobs, entropy = logprobs_and_entropy(logits, labels[0, keep], temperature, with_entropy)
        return (logprobs,) if entropy is None else (logprobs, entropy)

    return compute


def _values(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor]:
    return (model(**packing.model_kwargs()).logits[0, keep, 0].float(),)  # [K] of [1, nnz, 1]


def response_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    max_tokens: int,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
) -> torch.Tensor:
    """Critic values ``[B, T]`` (a token-classification model with one label), V of the state
    before each response token; same micro-batching and packing as :func:`response_logprobs`."""
    (values,) = per_response_token(
        model,
        input_ids,
        attention_mask,
        response_length,
        _values,
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
    )
    return values


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    max_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
    num_micro_batches: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response token | everything before it), and optionally the entropy there.

    Args:
        model: a causal LM (plain or FSDP-sharded) taking ``input_ids``/``position_ids``.
        input_ids: ``[B, P + T]`` prompt (left-padded) + response (right-padded).
        attention_mask: ``[B, P + T]``.
        response_length: T.
        max_tokens: per micro-batch token budget (e.g. ``log_prob_max_token_len_per_gpu``).
        temperature: divide the logits by it (the sampling temperature).
        with_entropy: also return the entropy of each response position's distribution.
        micro_batch_size: fixed micro-batches of this many sequences instead of the budget.
        num_micro_batches: force this count (after ``batching.sync_num_micro_batches``).

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``; values at response padding are not
        meaningful (mask them with the response mask). Differentiable.
    """
    outputs = per_response_token(
        model,
        input_ids,
        attention_mask,
        response_length,
        _logprobs_fn(temperature, with_entropy),
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
    )
    return outputs[0], outputs[1] if with_entropy else None
