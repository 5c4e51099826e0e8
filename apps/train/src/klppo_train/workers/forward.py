"""Per-token log-probs (actor, reference) and values (critic) of responses, and a reward
model's score of each response.

Micro-batching, packing and order restore are :func:`batching.per_response_token`'s (verl's
layout: left-padded prompts then right-padded responses, ``[B, P + T]``); here is what runs
on each packed row: the model, whose attention stays inside each sequence
(:mod:`klppo_train.runtime.packed_attention`: ``klppo_varlen``, linear in Σ Lᵢ²), then log-probs and
entropy in fp32 chunks (:func:`ppo_core.logprobs_and_entropy`) or the value head. Only the
positions that predict a response token get logits (``logits_to_keep``: the prompt's ~half
of the ``[tokens, vocab]`` head is never computed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from batching import PackedFn, Packing, next_token_labels, per_response_token, run_micro_batch
from klppo_train.budgets.faults import FAULTS
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.runtime.process_group import failed_ranks
from klppo_train.runtime.sequence_parallel import SequenceParallel, SequenceShard
from ppo_core import logprobs_and_entropy, sum_pi_squared_from_logits

NO_SP = SequenceParallel()


def _checked_sharing(model: nn.Module, share_prompts: bool) -> bool:
    # Any other attention ignores the shared layout and attends across sequences: refuse
    # rather than return wrong numbers (the config check makes this a bug, not a user error).
    attention = getattr(model.config, "_attn_implementation", None)
    if share_prompts and attention != VARLEN:
        raise ValueError(f"share_prompts needs the {VARLEN} attention; the model has {attention}")
    return share_prompts


def agreeing(compute: PackedFn) -> PackedFn:
    """``compute``, after which the ranks agree whether any of them ran out of memory in it
    (:func:`klppo_train.runtime.process_group.failed_ranks`) and then all raise
    ``torch.OutOfMemoryError``, so the OOM back-off halves the budget and redoes the pass on
    every rank together. Mended thus: an OOM raised after the micro-batch's model forward
    (the logits, the log-softmax: the largest allocations) or before it. One raised inside
    a layer or in the backward leaves the other ranks in a collective this rank skipped:
    they stop at ``trainer.collective_timeout_s``."""

    def run(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        error, out = "", None
        try:
            out = compute(model, packing, keep)
        except torch.OutOfMemoryError as err:
            error = str(err).splitlines()[0] if str(err) else "out of memory"
        # Outside the except block: the failed forward's frames (and memory) are gone.
        failed = failed_ranks(bool(error))
        if failed:
            raise torch.OutOfMemoryError(error or f"out of memory on rank {failed[0]}")
        return out

    return run


def _logprobs_fn(
    temperature: float, with_entropy: bool, sp: SequenceParallel, with_sum_pi_squared: bool
) -> PackedFn:
    @agreeing
    def compute(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shard = SequenceShard(packing, sp)
        mine, local = shard.split(keep)
        # squeeze, not [0]: select's backward zero-fills a [1, K, V] gradient and copies
        # into it (SmolLM2, 2800 kept tokens: 276 MB, ~0.5 s per actor update on CPU).
        logits = model(**shard.model_kwargs(), logits_to_keep=local).logits.squeeze(0)
        FAULTS.micro_batch()  # the OOM test hook (klppo_train.budgets.faults): nothing when unset
        labels, _ = next_token_labels(packing)
        logprobs, entropy = logprobs_and_entropy(logits, labels[0, mine], temperature, with_entropy)
        outputs = (logprobs,) if entropy is None else (logprobs, entropy)
        if with_sum_pi_squared:  # one more no-grad pass over the logits (the OTB's input)
            outputs += (sum_pi_squared_from_logits(logits, temperature),)
        return tuple(shard.gather(t, local, keep) for t in outputs)

    return compute


def _scalar_head(model: nn.Module, packing: Packing, at: torch.Tensor, sp) -> torch.Tensor:
    """A one-label head's outputs ``[K]`` at the row's distinct positions ``at``."""
    shard = SequenceShard(packing, sp)
    _, local = shard.split(at)
    out = model(**shard.model_kwargs()).logits[0, local, 0].float()  # of [1, nnz, 1]
    FAULTS.micro_batch()  # the OOM test hook (klppo_train.budgets.faults): nothing when unset
    return shard.gather(out, local, at)


def _values_fn(sp: SequenceParallel) -> PackedFn:
    @agreeing
    def compute(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor]:
        return (_scalar_head(model, packing, keep, sp),)

    return compute


def _token_scores_fn(sp: SequenceParallel) -> PackedFn:
    @agreeing
    def compute(model: nn.Module, packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor]:
        # keep predicts each response token; keep + 1 is that token itself (sequences are
        # packed contiguously here: no prompt sharing), where a reward model's head reads. A
        # response shorter than T also keeps its last token, whose "next" is padding (masked
        # out): the clamp only keeps the packed row's very last one in bounds, and unique
        # drops the duplicate it makes (a split row's gather scatters each position once).
        at = (keep + 1).clamp(max=packing.input_ids.shape[1] - 1)
        at, inverse = torch.unique(at, return_inverse=True)
        return (_scalar_head(model, packing, at, sp)[inverse],)

    return compute


def last_token_values(per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's value at its last valid response token (0 for an empty one)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=1).values
    values = per_token.gather(1, last.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(last >= 0, values, torch.zeros_like(values))


def response_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    max_tokens: int | None,
    micro_batch_size: int | None = None,
    sp: SequenceParallel = NO_SP,
) -> torch.Tensor:
    """A reward model's score of each response ``[B]``: its scalar head (a token-classification
    model with one label) at the response's last valid token -- the EOS of a finished
    response, the last kept token of a cut one, wherever padding is (the attention mask
    says, not a pad id: pad may equal EOS). Micro-batching as :func:`response_logprobs`;
    differentiable."""
    (per_token,) = _per_response_token(
        model,
        input_ids,
        attention_mask,
        response_length,
        _token_scores_fn(sp),
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        share_prompts=False,
    )
    return last_token_values(per_token, attention_mask[:, -response_length:])


def _per_response_token(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    compute: PackedFn,
    *,
    max_tokens: int | None,
    micro_batch_size: int | None,
    share_prompts: bool,
) -> list[torch.Tensor]:
    share = _checked_sharing(model, share_prompts)
    if max_tokens is None:  # one micro-batch the caller planned (an update's)
        args = (model, input_ids, attention_mask, response_length, compute)
        return run_micro_batch(*args, share_prompts=share)
    return per_response_token(
        model,
        input_ids,
        attention_mask,
        response_length,
        compute,
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        share_prompts=share,
    )


def response_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    max_tokens: int | None,
    micro_batch_size: int | None = None,
    share_prompts: bool = False,
    sp: SequenceParallel = NO_SP,
) -> torch.Tensor:
    """Critic values ``[B, T]`` (a token-classification model with one label), V of the state
    before each response token; same micro-batching and packing as :func:`response_logprobs`."""
    (values,) = _per_response_token(
        model,
        input_ids,
        attention_mask,
        response_length,
        _values_fn(sp),
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
        share_prompts=share_prompts,
    )
    return values


class LogProbs(NamedTuple):
    """A log-prob pass's outputs, ``[B, T]`` each: log π of the response tokens, and where
    asked the entropy and Σ_v π_v² of each position's distribution (else None)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


def logprob_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    max_tokens: int | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    micro_batch_size: int | None = None,
    share_prompts: bool = False,
    sp: SequenceParallel = NO_SP,
) -> LogProbs:
    """log π(response token | everything before it), and optionally the entropy and Σπ²
    there.

    Args:
        model: a causal LM (plain or FSDP-sharded) taking ``input_ids``/``position_ids``.
        input_ids: ``[B, P + T]`` prompt (left-padded) + response (right-padded).
        attention_mask: ``[B, P + T]``.
        response_length: T.
        max_tokens: per micro-batch token budget (e.g. ``log_prob_max_token_len_per_gpu``);
            None: the batch is one micro-batch its caller planned (an update's: no plan,
            no collective, :func:`batching.run_micro_batch`).
        temperature: divide the logits by it (the sampling temperature).
        with_entropy: also return the entropy of each response position's distribution.
        with_sum_pi_squared: also return Σ_v π_v² there (not differentiable; verl's
            ``calculate_sum_pi_squared``, for the optimal token baseline).
        micro_batch_size: fixed micro-batches of this many sequences instead of the budget.
        share_prompts: the samples of a prompt run its tokens once per micro-batch
            (``batching.pack_shared_prompts``; ``model.share_prompts``); needs the
            ``klppo_varlen`` attention. ``max_tokens`` then counts the tokens that run.
        sp: the sequence-parallel group (:mod:`klppo_train.runtime.sequence_parallel`):
            its ranks hold the same batch and each runs the model on a slice of each
            packed row (``klppo_varlen`` attention; no ``share_prompts``).

    Returns:
        :class:`LogProbs`; values at response padding are not meaningful (mask them with
        the response mask). Differentiable (the log-probs and the entropy).
    """
    outputs = iter(
        _per_response_token(
            model,
            input_ids,
            attention_mask,
            response_length,
            _logprobs_fn(temperature, with_entropy, sp, with_sum_pi_squared),
            max_tokens=max_tokens,
            micro_batch_size=micro_batch_size,
            share_prompts=share_prompts,
        )
    )
    logprobs = next(outputs)
    entropy = next(outputs) if with_entropy else None
    return LogProbs(logprobs, entropy, next(outputs) if with_sum_pi_squared else None)


def response_logprobs(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [B, T], entropy [B, T] or None)``: :func:`logprob_outputs` (same
    arguments) without Σπ². Differentiable."""
    out = logprob_outputs(*args, **kwargs)
    return out.logprobs, out.entropy
