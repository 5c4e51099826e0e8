"""A trained model (actor or critic) and its update: one code path for both.

:meth:`Trainee.update` runs ``epochs`` over shuffled mini-batches of whole prompts; each
mini-batch is one optimizer step over micro-batches cut within the update pass's token
budget (or of verl's static size), every micro-batch's loss its exact share of the
mini-batch's global token-mean (:class:`klppo_train.ppo.losses.GlobalCounts`). All ranks run the
same number of micro-batches (FSDP's collectives pair up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batching import micro_batch_plan, prompt_prefixes
from fsdp_sharding import (
    clip_grad_norm,
    load_checkpoint,
    load_optimizer,
    offload_optimizer,
    save_checkpoint,
)
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.ppo.losses import GlobalCounts, MicroBatchLoss
from klppo_train.ppo.passes import Pass
from klppo_train.ppo.trajectories import Trajectories
from ppo_core import SHARE_METRICS


@dataclass(frozen=True, kw_only=True)
class Trainee:
    """Attributes:
    name: ``actor`` | ``critic``: the metrics' prefix (``actor/pg_loss``).
    model, optimizer: the sharded model and its optimizer.
    loss: the micro-batch loss, built with its hyperparameters.
    update: the update pass (its name, role and static micro-batch size).
    epochs: passes over the step's samples (``ppo_epochs``).
    rows_per_mini_batch: this rank's samples per optimizer step.
    grad_clip: the gradient norm's bound.
    offload_optimizer: the optimizer state lives on CPU except during its step.
    share_prompts: a prompt's samples stay in one micro-batch and its prefix counts once.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: MicroBatchLoss
    update: Pass
    epochs: int
    rows_per_mini_batch: int
    grad_clip: float = 1.0
    offload_optimizer: bool = False
    share_prompts: bool = False

    def save(self, path: Path, extra_state: dict[str, Any] | None = None) -> None:
        """Model shards and optimizer state into ``path`` (a collective), with
        ``extra_state`` (:func:`fsdp_sharding.save_checkpoint`)."""
        save_checkpoint(path, self.model, self.optimizer, extra_state=extra_state)

    def load(self, path: Path) -> dict[str, Any]:
        """What :meth:`save` wrote; returns its ``extra_state``."""
        return load_checkpoint(path, self.model, self.optimizer)

    def accumulate(self, batch: Trajectories, max_tokens: int) -> dict[str, float]:
        """Backward every micro-batch of ``batch`` into the gradients; ``{name}/*`` metrics,
        token-weighted (a metric named with its own ``/`` is kept as is; ``*_max`` ones take
        the maximum)."""
        mask = batch.response_mask
        counts = GlobalCounts.of(mask)
        prefixes = None
        if self.share_prompts:
            prompt_length = batch.input_ids.shape[1] - mask.shape[1]
            prefixes = prompt_prefixes(batch.input_ids, batch.attention_mask, prompt_length)
        plan = micro_batch_plan(
            batch.attention_mask.sum(-1),
            max_tokens,
            self.update.micro_batch_size,
            sync_ranks=True,
            prefixes=prefixes,
        )
        totals: dict[str, float] = {}
        for members in plan.micro_batches:
            mb = batch.rows(torch.tensor(members, device=mask.device))
            loss, metrics = self.loss(self.model, mb, counts)
            loss.backward()
            weight = float(mb.response_mask.sum()) / max(float(mask.sum()), 1.0)
            for name, value in metrics.items():
                share = 1.0 if name in SHARE_METRICS else weight
                key = name if "/" in name else f"{self.name}/{name}"
                _aggregate(totals, key, float(value), share)
        return totals

    def optimizer_step(self, batch: Trajectories, max_tokens: int) -> dict[str, float]:
        """:meth:`accumulate`, clip, step (skipped on a non-finite norm), zero the gradients;
        the metrics with ``{name}/grad_norm``."""
        totals = self.accumulate(batch, max_tokens)
        grad_norm = clip_grad_norm(self.model, self.grad_clip)
        if torch.isfinite(grad_norm):
            if self.offload_optimizer:
                load_optimizer(self.optimizer, next(self.model.parameters()).device)
            self.optimizer.step()
            if self.offload_optimizer:
                offload_optimizer(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        totals[f"{self.name}/grad_norm"] = float(grad_norm)
        return totals

    def train(self, t: Trajectories, budgets: RunBudgets, step: int) -> dict[str, float]:
        """The step's update: ``epochs`` over mini-batches of whole prompts (shuffled with
        the step as seed), each an optimizer step within the budget in force (an
        out-of-memory error zeroes the gradients, halves the budget and redoes the
        mini-batch); the metrics averaged over the optimizer steps."""
        sums: dict[str, float] = {}
        steps = 0
        for epoch in range(self.epochs):
            for rows in mini_batches(t.prompt_index, self.rows_per_mini_batch, step + epoch):
                metrics = self._optimizer_step_with_backoff(t.rows(rows), budgets, step)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value
                steps += 1
        return {name: value / steps for name, value in sums.items()}

    def _optimizer_step_with_backoff(
        self, mb: Trajectories, budgets: RunBudgets, step: int
    ) -> dict[str, float]:
        return self.update.run(
            budgets,
            step,
            lambda budget: self.optimizer_step(mb, budget),
            reset=lambda: self.optimizer.zero_grad(set_to_none=True),
        )


def mini_batches(prompts: torch.Tensor, rows_per_mini: int, seed: int) -> list[torch.Tensor]:
    """Row indices of mini-batches in a shuffled order of whole prompts (``prompts``: each
    row's prompt index): a prompt's ``n`` samples stay in one mini-batch (as in verl, whose
    mini-batches count prompts) whenever ``rows_per_mini`` is a multiple of ``n``, so
    GRPO-style groups and shared prompt tokens (``model.share_prompts``) stay together."""
    _, prompt = torch.unique(prompts.cpu(), return_inverse=True)
    shuffled = torch.randperm(int(prompt.max()) + 1, generator=torch.Generator().manual_seed(seed))
    place = torch.empty_like(shuffled)
    place[shuffled] = torch.arange(len(shuffled))
    order = torch.argsort(place[prompt], stable=True)
    return [order[i : i + rows_per_mini] for i in range(0, len(order), rows_per_mini)]


def _aggregate(totals: dict[str, float], name: str, value: float, weight: float) -> None:
    # Maxima over tokens (``*_max``): the step's is the largest micro-batch's.
    if name.endswith("_max"):
        totals[name] = max(totals.get(name, value), value)
    else:
        totals[name] = totals.get(name, 0.0) + weight * value
