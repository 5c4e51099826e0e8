"""Data-parallel balancing of a step's rollouts (verl's ``trainer.balance_batch``).

Each rank generates for its share of the prompts, so the rank whose prompts drew the long
responses holds the most tokens and sets every later pass's pace. After generation the
ranks exchange their (prompt, samples) groups and re-split them with
``batching.balance_across_ranks``: equal numbers of groups per rank (the optimizer and FSDP
need equal shares), tokens as even as Karmarkar-Karp makes them, all ``n`` samples of a
prompt on one rank (GRPO/RLOO groups stay whole). Every rank computes the same assignment
from the same gathered loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from batching import RankAssignment, balance_across_ranks
from klppo_train.data.datasets import PromptItem
from klppo_train.runtime.process_group import dp_group, dp_rank, dp_size
from rollout import RolloutBatch, Sample

Group = tuple[PromptItem, list[Sample]]


def _groups(items: Sequence[PromptItem], batch: RolloutBatch) -> list[Group]:
    by_prompt: list[list[Sample]] = [[] for _ in items]
    for sample in batch.samples:
        by_prompt[sample.prompt_index].append(sample)
    return list(zip(items, by_prompt, strict=True))


def _load(group: Group) -> int:
    item, samples = group
    return sum(len(item.prompt_ids) + len(s.response_token_ids) for s in samples)


def _as_generated(counts: list[int], loads: list[int]) -> RankAssignment:
    """The split the ranks generated with: rank r holds the next ``counts[r]`` groups."""
    starts = [sum(counts[:r]) for r in range(len(counts))]
    ranks = tuple(tuple(range(s, s + n)) for s, n in zip(starts, counts, strict=True))
    return RankAssignment(ranks, tuple(sum(loads[i] for i in held) for held in ranks))


def balance_rollouts(
    items: Sequence[PromptItem], batch: RolloutBatch
) -> tuple[list[PromptItem], RolloutBatch, dict[str, float], list[int]]:
    """This rank's balanced share of every rank's ``(items, batch)``,
    ``perf/dp_imbalance_{before,after}`` (max / mean tokens per rank) and the positions of
    the share's prompts in the step's batch (the ranks' prompts in rank order). A
    collective; at world size 1 the input comes back unchanged (and no metrics)."""
    world = dp_size()
    if world == 1:
        return list(items), batch, {}, list(range(len(items)))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, _groups(items, batch), group=dp_group())
    groups = [group for rank_groups in gathered for group in rank_groups]
    loads = [_load(g) for g in groups]
    before = _as_generated([len(rank_groups) for rank_groups in gathered], loads)
    assignment = balance_across_ranks(loads, world)
    positions = list(assignment.ranks[dp_rank()])
    mine = [groups[g] for g in positions]
    samples = [replace(s, prompt_index=i) for i, (_, group) in enumerate(mine) for s in group]
    metrics = {
        "perf/dp_imbalance_before": before.imbalance,
        "perf/dp_imbalance_after": assignment.imbalance,
    }
    batch = RolloutBatch(samples, batch.policy_version)
    return [item for item, _ in mine], batch, metrics, positions


def split_groups(
    prompt_index: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: int,
    world: int,
    balance: bool = True,
) -> tuple[list[list[int]], dict[str, float]]:
    """A whole batch's (prompt, samples) groups split over ``world`` data-parallel ranks as
    :func:`balance_rollouts` splits the ranks' own (for a generating rank that generated
    all of them): per rank the prompts it gets (ascending), and
    ``perf/dp_imbalance_{before,after}`` (before: as ``world`` colocated ranks would have
    generated them, an equal run of prompts each). ``prompt_index``: ``[N]``,
    ``attention_mask``: ``[N, L]``; a sample's load is its prompt and response tokens.
    ``balance=False`` (``trainer.balance_batch=false``): the equal runs, as generated."""
    tokens = attention_mask.sum(dim=1).to("cpu", torch.long)
    loads = torch.zeros(prompts, dtype=torch.long).index_add_(0, prompt_index.cpu(), tokens)
    loads = loads.tolist()
    before = _as_generated([prompts // world] * world, loads)
    assignment = balance_across_ranks(loads, world) if balance else before
    metrics = {
        "perf/dp_imbalance_before": before.imbalance,
        "perf/dp_imbalance_after": assignment.imbalance,
    }
    return [list(held) for held in assignment.ranks], metrics
