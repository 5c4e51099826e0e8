"""Training a reward model: the pairwise loss on micro-batches of whole pairs, the trainee
that takes one optimizer step per batch of pairs, and the held-out pairwise accuracy.

The update is :class:`klppo_train.workers.trainee.Trainee`'s (clip, optimizer step, offload,
checkpoint, OOM back-off within the ``reward_training`` budget); what differs is the unit:
a micro-batch holds whole pairs (the Bradley–Terry loss needs both scores of a pair), cut
within the token budget by the pairs' summed lengths, and each micro-batch's loss is its
exact share of the mean over all pairs of the batch on all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batching import micro_batch_plan
from fsdp_sharding import default_device
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.data.pairs import Pair
from klppo_train.runtime.process_group import (
    concat_over_ranks,
    rank_slice,
    sum_over_ranks,
    world_size,
)
from klppo_train.workers.forward import response_scores
from klppo_train.workers.trainee import Trainee, _aggregate
from klppo_train.workers.trajectories import Trajectories
from ppo_core import pairwise_reward_loss
from rollout import left_pad


def pair_batch(
    pairs: Sequence[Pair], pad_token_id: int, device
) -> tuple[Trajectories, torch.Tensor]:
    """``(sequences, margins [B])``: rows 2i (chosen) and 2i + 1 (rejected) of pair i in
    verl's layout, prompts left-padded, responses right-padded to the longest;
    ``prompt_index`` = the pair (a pair stays in one mini- and micro-batch)."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen_ids, p.rejected_ids)]
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(len(r) for r in responses)
    response_ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(responses), width, dtype=torch.long)
    for row, ids in enumerate(responses):
        response_ids[row, : len(ids)] = torch.tensor(ids)
        response_mask[row, : len(ids)] = 1
    t = Trajectories(
        input_ids=torch.cat([prompt_ids, response_ids], 1).to(device),
        attention_mask=torch.cat([prompt_mask, response_mask], 1).to(device),
        response_mask=response_mask.to(device),
        engine_logprobs=torch.zeros(response_mask.shape, device=device),
        prompt_index=torch.arange(len(pairs), device=device).repeat_interleave(2),
    )
    return t, torch.tensor([p.margin for p in pairs], device=device)


@dataclass(frozen=True)
class PairBatch:
    """Pairs in verl's layout (rows 2i chosen, 2i + 1 rejected) and their margins ``[B]``."""

    sequences: Trajectories
    margins: torch.Tensor

    @classmethod
    def of(cls, pairs: Sequence[Pair], pad_token_id: int) -> PairBatch:
        return cls(*pair_batch(pairs, pad_token_id, default_device()))

    def pairs(self, index: torch.Tensor) -> PairBatch:
        rows = torch.stack([2 * index, 2 * index + 1], dim=1).flatten()
        return PairBatch(self.sequences.rows(rows), self.margins[index])

    def scores(self, model, max_tokens: int | None, micro_batch_size: int | None = None):
        """``(chosen [B], rejected [B])`` scores."""
        t = self.sequences
        scores = response_scores(
            model,
            t.input_ids,
            t.attention_mask,
            t.response_mask.shape[1],
            max_tokens=max_tokens,
            micro_batch_size=micro_batch_size,
        )
        return scores[0::2], scores[1::2]


@dataclass(frozen=True)
class PairwiseLoss:
    """``ppo_core.pairwise_reward_loss`` with its centering coefficient, as a share of the
    mean over ``global_pairs`` (all ranks' pairs of the batch): FSDP averages the ranks'
    gradients, so each rank's share is scaled by the world size."""

    center_coef: float = 0.0

    def __call__(self, model, mb: PairBatch, global_pairs: torch.Tensor):
        chosen, rejected = mb.scores(model, max_tokens=None)
        loss, metrics = pairwise_reward_loss(chosen, rejected, mb.margins, self.center_coef)
        share = len(mb.margins) * world_size() / global_pairs
        return loss * share, {"loss": loss.detach(), **metrics}


@dataclass(frozen=True, kw_only=True)
class RewardTrainee(Trainee):
    """The reward model's trainee (``name`` ``reward_model``): one optimizer step per batch
    of pairs. ``update.micro_batch_size`` (static mode) counts sequences, two per pair."""

    def accumulate(
        self, batch: PairBatch | Trajectories, max_tokens: int, filler: None = None
    ) -> dict[str, float]:
        """Backward every micro-batch of whole pairs; ``rm/*`` metrics (pair means). Every
        rank holds an equal share of the pairs: no filler micro-batches."""
        if isinstance(batch, Trajectories):  # the budget probe's synthetic rows, paired up
            batch = PairBatch(batch, torch.zeros(len(batch.input_ids) // 2))
        pairs = len(batch.margins)
        global_pairs = sum_over_ranks(torch.tensor(float(pairs), device=batch.margins.device))
        lengths = batch.sequences.attention_mask.sum(-1).view(-1, 2).sum(-1)
        static = self.update.micro_batch_size
        plan = micro_batch_plan(
            lengths, max_tokens, static // 2 if static else None, sync_ranks=True
        )
        totals: dict[str, float] = {}
        for members in plan.micro_batches:
            mb = batch.pairs(torch.tensor(members, dtype=torch.long, device=lengths.device))
            loss, metrics = self.loss(self.model, mb, global_pairs)
            loss.backward()
            for name, value in metrics.items():
                _aggregate(totals, f"rm/{name}", float(value), len(members) / pairs)
        return totals

    def train(self, batch: PairBatch, budgets: RunBudgets, step: int) -> dict[str, float]:
        """One optimizer step on the batch within the budget in force (an out-of-memory
        error zeroes the gradients, halves the budget and redoes it)."""
        metrics = self._optimizer_step_with_backoff(batch, budgets, step)
        metrics["rm/grad_norm"] = metrics.pop(f"{self.name}/grad_norm")  # with the rm/* ones
        return metrics


@torch.no_grad()
def pairwise_accuracy(
    model, pairs: Sequence[Pair], pad_token_id: int, max_tokens: int, batch_size: int = 256
) -> tuple[dict[str, float], list[float]]:
    """Held-out ``val/rm/*`` metrics over all ranks' shares of ``pairs`` (accuracy, mean
    margin, the scores' mean and std) and every score (for the stored normalization)."""
    model.eval()
    found: dict[str, list[float]] = {"hits": [], "margins": [], "scores": []}
    mine = rank_slice(pairs)
    per_rank = -(-len(pairs) // world_size())  # the same number of passes on every rank
    for start in range(0, per_rank, batch_size):
        chunk = mine[start : start + batch_size]
        # a rank with none left still joins the pass's collectives (on one pair, unused)
        chosen, rejected = PairBatch.of(chunk or pairs[:1], pad_token_id).scores(model, max_tokens)
        if chunk:
            found["hits"] += (chosen > rejected).float().tolist()
            found["margins"] += (chosen - rejected).tolist()
            found["scores"] += chosen.tolist() + rejected.tolist()
    model.train()
    found = concat_over_ranks(found)
    scores = torch.tensor(found["scores"], dtype=torch.float64)
    metrics = {
        "val/rm/accuracy": sum(found["hits"]) / len(found["hits"]),
        "val/rm/margin": sum(found["margins"]) / len(found["margins"]),
        "val/rm/score_mean": float(scores.mean()),
        "val/rm/score_std": float(scores.std()) if len(scores) > 1 else 0.0,
    }
    return metrics, found["scores"]
