"""A trained model (actor or critic) and its update: one code path for both.

:meth:`Trainee.train` runs ``epochs`` over shuffled mini-batches of whole prompts; each
mini-batch is one optimizer step over micro-batches cut within the update pass's token
budget (or of verl's static size), every micro-batch's loss its exact share of the
mini-batch's global token-mean (:class:`klppo_train.workers.losses.GlobalCounts`). All ranks run the
same number of micro-batches (FSDP's collectives pair up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batching import micro_batch_plan, prompt_prefixes, sync_num_micro_batches
from fsdp_sharding import (
    clip_grad_norm,
    load_checkpoint,
    load_optimizer,
    offload_optimizer,
    save_checkpoint,
)
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.runtime.process_group import dp_size, sum_over_ranks
from klppo_train.workers.losses import GlobalCounts, MicroBatchLoss
from klppo_train.workers.passes import Pass
from klppo_train.workers.trajectories import Trajectories
from ppo_core import SHARE_METRICS


@dataclass(frozen=True, kw_only=True)
class Trainee:
    """Attributes:
    name: ``actor`` | ``critic``: the metrics' prefix (``actor/pg_loss``).
    model, optimizer: the sharded model and its optimizer.
    loss: the micro-batch loss, built with its hyperparameters.
    update: the update pass (its name, role and static micro-batch size).
    epochs: passes over the step's samples (``ppo_epochs``).
    prompts_per_mini_batch: prompts (over all ranks) per optimizer step (``ppo_mini_batch_size``);
        0: the whole step's.
    rows_per_mini_batch: the most samples one rank can hold in one mini-batch (the budget
        probe's cap).
    grad_clip: the gradient norm's bound.
    offload_optimizer: the optimizer state lives on CPU except during its step.
    share_prompts: a prompt's samples stay in one micro-batch and its prefix counts once.
    saves_frozen: checkpoints hold the frozen parameters too (false for a LoRA actor: its
        base is rebuilt from the model directory, the checkpoint holds the adapters).
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: MicroBatchLoss
    update: Pass
    epochs: int
    rows_per_mini_batch: int
    prompts_per_mini_batch: int = 0
    grad_clip: float = 1.0
    offload_optimizer: bool = False
    share_prompts: bool = False
    saves_frozen: bool = True

    def save(self, path: Path, extra_state: dict[str, Any] | None = None) -> None:
        """Model shards and optimizer state into ``path`` (a collective), with
        ``extra_state`` (:func:`fsdp_sharding.save_checkpoint`)."""
        save_checkpoint(
            path, self.model, self.optimizer, extra_state=extra_state, frozen=self.saves_frozen
        )

    def load(self, path: Path) -> dict[str, Any]:
        """What :meth:`save` wrote; returns its ``extra_state``."""
        return load_checkpoint(path, self.model, self.optimizer, frozen=self.saves_frozen)

    def accumulate(
        self, batch: Trajectories, max_tokens: int, filler: Trajectories | None = None
    ) -> dict[str, float]:
        """Backward every micro-batch of ``batch`` into the gradients; ``{name}/*`` metrics
        as this rank's shares of the mini-batch's global values (a metric named with its own
        ``/`` is kept as is; ``*_max`` ones take the maximum). Micro-batches the other ranks
        run beyond this rank's own are ``filler`` (one row; default ``batch``'s first) with
        its loss times zero: FSDP's collectives pair up, the gradient is unchanged."""
        mask = batch.loss_mask
        counts = GlobalCounts.of(mask)
        total = max(float(counts.global_num_tokens), 1.0)
        plan = self._plan(batch, max_tokens)
        filler = filler if filler is not None else batch.rows(torch.tensor([0]))
        totals: dict[str, float] = {}
        for members in plan:
            real = bool(members)
            mb = batch.rows(torch.tensor(members, device=mask.device)) if real else filler
            loss, metrics = self.loss(self.model, mb, counts)
            (loss if real else loss * 0.0).backward()
            weight = float(mb.loss_mask.sum()) / total if real else 0.0
            for name, value in metrics.items():
                share = (1.0 / counts.dp_size if real else 0.0) if name in SHARE_METRICS else weight
                key = name if "/" in name else f"{self.name}/{name}"
                _aggregate(totals, key, float(value), share, real)
        return totals

    def _plan(self, batch: Trajectories, max_tokens: int) -> list[list[int]]:
        """This rank's micro-batches (lists of rows), as many as the rank that needs the most
        (``[]``: a filler): re-cut into more when it has the rows, else padded."""
        rows = batch.response_mask.shape[0]
        lengths = batch.attention_mask.sum(-1)
        prefixes = None
        if self.share_prompts:
            prompt_length = batch.input_ids.shape[1] - batch.response_length
            prefixes = prompt_prefixes(batch.input_ids, batch.attention_mask, prompt_length)

        def plan(count: int | None) -> list[list[int]]:
            if not rows:
                return []
            found = micro_batch_plan(
                lengths, max_tokens, self.update.micro_batch_size, count, prefixes=prefixes
            )
            return [list(m) for m in found.micro_batches]

        own = plan(None)
        count = sync_num_micro_batches(len(own))
        if self.update.micro_batch_size is None and len(own) < count and rows > len(own):
            own = plan(min(count, rows))  # spread over the micro-batches every rank runs
        return own + [[] for _ in range(count - len(own))]

    def optimizer_step(
        self, batch: Trajectories, max_tokens: int, filler: Trajectories | None = None
    ) -> dict[str, float]:
        """:meth:`accumulate`, clip, step (skipped on a non-finite norm), zero the gradients;
        the metrics with ``{name}/grad_norm``."""
        totals = self.accumulate(batch, max_tokens, filler)
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
        """The step's update: ``epochs`` over global mini-batches of whole prompts
        (:func:`mini_batches`, seeded with the step and epoch), each an optimizer step within
        the budget in force (an out-of-memory error zeroes the gradients, halves the budget
        and redoes the mini-batch); the metrics averaged over the optimizer steps and
        reduced over the ranks (the same on every rank)."""
        positions = t.prompt_position if t.prompt_position is not None else t.prompt_index
        prompts = int(sum_over_ranks(torch.tensor(len(torch.unique(positions)))))
        per_mini = self.prompts_per_mini_batch or prompts
        filler = t.rows(torch.tensor([0], device=t.response_mask.device))
        per_step = []
        for epoch in range(self.epochs):
            for rows in mini_batches(positions, per_mini, step + epoch, prompts):
                per_step.append(
                    self._optimizer_step_with_backoff(t.rows(rows), budgets, step, filler)
                )
        return mean_over_steps(per_step)

    def _optimizer_step_with_backoff(
        self, mb: Trajectories, budgets: RunBudgets, step: int, filler: Trajectories | None = None
    ) -> dict[str, float]:
        return self.update.run(
            budgets,
            step,
            lambda budget: self.optimizer_step(mb, budget, filler),
            reset=lambda: self.optimizer.zero_grad(set_to_none=True),
        )


def mini_batches(
    positions: torch.Tensor, prompts_per_mini: int, seed: int, prompts: int | None = None
) -> list[torch.Tensor]:
    """This rank's row indices of each mini-batch: the step's ``prompts`` prompts (over all
    ranks; default: ``positions.max() + 1``) in one order seeded by ``seed`` -- the same on
    every rank -- cut into mini-batches of ``prompts_per_mini``; ``positions`` ``[N]``: each
    local row's prompt (its position in the step's batch over all ranks). A prompt's samples
    stay in one mini-batch (verl's mini-batches count prompts), so GRPO-style groups and
    shared prompt tokens (``model.share_prompts``) stay together. A mini-batch may hold none
    of this rank's rows (an empty index)."""
    positions = positions.cpu()
    count = prompts if prompts is not None else int(positions.max()) + 1
    shuffled = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    place = torch.empty_like(shuffled)
    place[shuffled] = torch.arange(count)
    order = torch.argsort(place[positions], stable=True)
    which = place[positions][order] // prompts_per_mini
    return [order[which == j] for j in range(-(-count // prompts_per_mini))]


def mean_over_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps' metrics averaged, each step's reduced over the ranks first:
    shares summed, ``*_max`` and ``grad_norm`` (already global) by maximum."""
    keys = sorted(per_step[0])
    if dp_size() > 1:
        values = torch.tensor([[m[k] for k in keys] for m in per_step], dtype=torch.float64)
        largest = torch.tensor([k.endswith(("_max", "grad_norm")) for k in keys])
        summed = sum_over_ranks(torch.where(largest, 0.0, values))
        maxima = values.clone()
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
        per_step = [
            dict(zip(keys, row, strict=True))
            for row in torch.where(largest, maxima, summed).tolist()
        ]
    return {k: sum(m[k] for m in per_step) / len(per_step) for k in keys}


def _aggregate(
    totals: dict[str, float], name: str, value: float, weight: float, real: bool = True
) -> None:
    # Maxima over tokens (``*_max``): the step's is the largest micro-batch's; a filler's
    # counts for nothing (its key is there, as the ranks' reduction needs the same keys).
    if name.endswith("_max"):
        totals[name] = max(totals.get(name, -math.inf), value if real else -math.inf)
    else:
        totals[name] = totals.get(name, 0.0) + (weight * value if real else 0.0)
