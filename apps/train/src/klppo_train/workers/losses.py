"""What a trainee asks of its loss: the mini-batch's global token and sequence counts (the
normalizers of ``ppo_core``'s losses) and the micro-batch loss Protocol. PPO's losses
(:mod:`klppo_train.ppo.losses`) and the reward model's pairwise loss implement it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn

from klppo_train.runtime.process_group import dp_size, sum_over_ranks
from klppo_train.workers.trajectories import Trajectories

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class GlobalCounts:
    """Valid tokens and sequences of a mini-batch over all ranks (``ppo_core``'s global
    normalizers: the keyword arguments of its losses)."""

    global_num_tokens: torch.Tensor
    global_num_seqs: torch.Tensor
    dp_size: int

    @classmethod
    def of(cls, loss_mask: torch.Tensor) -> GlobalCounts:
        """The counts of a loss mask ``[B, T]`` (this rank's rows), summed over ranks."""
        return cls(
            sum_over_ranks(loss_mask.sum()),
            sum_over_ranks((loss_mask.sum(-1) > 0).sum()),
            dp_size(),
        )

    def kwargs(self) -> dict:
        """The fields as ``ppo_core`` losses take them (keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class MicroBatchLoss(Protocol):
    def __call__(
        self, model: nn.Module, mb: Trajectories, counts: GlobalCounts
    ) -> tuple[torch.Tensor, Metrics]: ...
