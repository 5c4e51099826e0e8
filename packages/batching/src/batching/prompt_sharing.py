"""Shared-prompt packing: the ``n`` samples of a prompt run the prompt's tokens once.

In a PPO/GRPO batch every prompt comes with ``n`` responses, so a plain packed row holds each
prompt ``n`` times, and every linear layer of every pass (old and reference log-probs,
values, both updates) computes the same prompt tokens ``n`` times over. With prompts as long
as responses and ``n = 4`` that is ~40 % of a step's work. :func:`pack_shared_prompts` lays
a micro-batch out so that sequences whose prompts are identical share them:

    [prefix of prompt A] [last token of A, response A.1] [last token of A, response A.2] ...

The prefix is every prompt token but the last. The last prompt token predicts the first
response token, which differs per sample, so each sequence keeps its own copy: a packed
position then still predicts exactly one next token, and ``next_token_labels``,
``logits_to_keep`` and the scatter back to ``[B, S]`` (:func:`batching.per_response_token`)
work unchanged, for one extra token per sequence.

The packing's :attr:`~batching.Packing.layout` tells the attention which packed tokens each
sequence attends over (its prompt's prefix, then its own tokens) and which slot gives each
shared token's output (the first sequence of the prompt: causal attention over the prefix is
the same for all of them). The result is exact: every token sees what it sees in the padded
forward, at the same rotary position, and the backward sums every sequence's gradient into
the shared keys and values (the layout's gathers are ``index_select``, whose backward is an
``index_add``). It needs an attention that reads the layout (``varlen_causal_attention``, e.g.
through the trainer's ``klppo_varlen``); flash-attn's varlen kernel or a dense mask cannot
express a shared prefix.

Micro-batches keep a prompt's sequences together where the budget allows
(:func:`shared_prompt_plan`), and budgets count the tokens that actually run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batching.attention import DEFAULT_GROUP_RATIO, sequence_layout
from batching.micro_batches import (
    MicroBatchPlan,
    check_lengths,
    plan_from_parts,
    token_budget_micro_batches,
)
from batching.packing import Packing, pack


@dataclass(frozen=True)
class PromptPrefixes:
    """Which sequences of a batch share a prompt.

    Attributes:
        group: ``group[i]`` is the first sequence (row index) with sequence i's prompt.
        prefix: ``prefix[i]`` tokens of sequence i's prompt are shared: all but the last.
    """

    group: tuple[int, ...]
    prefix: tuple[int, ...]


def prompt_prefixes(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> PromptPrefixes:
    """Group the rows of a ``[B, P + T]`` batch by identical prompts (the first
    ``prompt_length`` columns: the same valid tokens in the same places)."""
    mask = attention_mask[:, :prompt_length].bool()
    keys = torch.where(mask, input_ids[:, :prompt_length], -1).tolist()
    first: dict[tuple[int, ...], int] = {}
    group = tuple(first.setdefault(tuple(k), row) for row, k in enumerate(keys))
    prefix = tuple(max(n - 1, 0) for n in mask.sum(-1).tolist())
    return PromptPrefixes(group, prefix)


def shared_token_count(members: list[int], lengths: list[int], prefixes: PromptPrefixes) -> int:
    """Packed tokens of ``members`` laid out by :func:`pack_shared_prompts`: each distinct
    prompt prefix once plus every sequence's own tokens."""
    groups = {prefixes.group[i]: prefixes.prefix[i] for i in members}
    return sum(groups.values()) + sum(lengths[i] - prefixes.prefix[i] for i in members)


def pack_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    ratio: float = DEFAULT_GROUP_RATIO,
) -> Packing:
    """:func:`batching.pack` with each distinct prompt's prefix packed once (module docstring).

    Args:
        input_ids: ``[B, P + T]`` left-padded prompts followed by responses.
        attention_mask: ``[B, P + T]``, 1 = valid token.
        prompt_length: P, the prompt columns.
        ratio: longest ÷ shortest sequence in one attention group.

    Returns:
        A :class:`~batching.Packing` with a :attr:`~batching.Packing.layout`. Its
        ``indices`` map a shared token to its first sequence's position, so :func:`unpack`
        fills the other sequences' prefix positions with the pad value; every other position
        (the last prompt token and the response) is each sequence's own.
    """
    plain = pack(input_ids, attention_mask)
    prefixes = prompt_prefixes(input_ids, attention_mask, prompt_length)
    device = plain.indices.device
    rows = plain.row_ids
    starts = plain.cu_seqlens[:-1].long()
    offset = torch.arange(plain.nnz, device=device) - starts[rows]
    lead = torch.tensor(prefixes.group, device=device, dtype=torch.long)[rows]
    prefix = torch.tensor(prefixes.prefix, device=device, dtype=torch.long)[rows]
    # The plain row minus every later sample's copy of its prompt's prefix; each sample's
    # slots then point at the kept tokens (a dropped prefix token: the lead's copy).
    dropped = (lead != rows) & (offset < prefix)
    source = torch.where(dropped, starts[lead] + offset, torch.arange(plain.nnz, device=device))
    kept = ~dropped
    attended = (kept.cumsum(0) - 1)[source]
    tokens = list(attended.split(plain.seq_lens.tolist()))
    pairs = zip(prefixes.group, prefixes.prefix, strict=True)
    not_owned = [0 if g == b else n for b, (g, n) in enumerate(pairs)]
    return replace(
        plain,
        input_ids=plain.input_ids[:, kept],
        position_ids=plain.position_ids[:, kept],
        indices=plain.indices[kept],
        layout=sequence_layout(tokens, not_owned, int(kept.sum()), ratio),
    )


def _prompt_units(lengths: list[int], prefixes: PromptPrefixes, max_tokens: int) -> list[list[int]]:
    """Sequences by prompt, a prompt's sequences split where together they exceed the
    budget (each part then carries the prefix)."""
    by_prompt: dict[int, list[int]] = {}
    for i, lead in enumerate(prefixes.group):
        by_prompt.setdefault(lead, []).append(i)
    units = []
    for members in by_prompt.values():
        unit: list[int] = []
        for i in members:
            if unit and shared_token_count([*unit, i], lengths, prefixes) > max_tokens:
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    return units


def _split_to(units: list[list[int]], count: int) -> list[list[int]]:
    """Halve the largest units until there are ``count`` (a forced micro-batch count larger
    than the prompts); stops at single sequences."""
    units = [list(u) for u in units]
    while len(units) < count and any(len(u) > 1 for u in units):
        largest = max(range(len(units)), key=lambda u: len(units[u]))
        unit = units.pop(largest)
        units += [unit[: len(unit) // 2], unit[len(unit) // 2 :]]
    return units


def shared_prompt_plan(
    seq_lens: list[int] | torch.Tensor,
    prefixes: PromptPrefixes,
    max_tokens: int,
    *,
    num_micro_batches: int | None = None,
) -> MicroBatchPlan:
    """:func:`~batching.token_budget_micro_batches` over whole prompts: a prompt's sequences
    stay in one micro-batch unless together they exceed ``max_tokens``; the budget (and
    ``plan.token_sums``) counts the tokens :func:`pack_shared_prompts` packs."""
    lens = check_lengths(seq_lens, max_tokens)
    units = _prompt_units(lens, prefixes, max_tokens)
    if num_micro_batches is not None:
        units = _split_to(units, num_micro_batches)
    unit_tokens = [shared_token_count(u, lens, prefixes) for u in units]
    unit_plan = token_budget_micro_batches(
        unit_tokens, max_tokens, num_micro_batches=num_micro_batches
    )
    parts = [[i for u in mb for i in units[u]] for mb in unit_plan.micro_batches]
    sums = [shared_token_count(p, lens, prefixes) for p in parts]
    return plan_from_parts(parts, len(lens), sums, max_tokens)
