"""Reward shaping applied to each response's sequence reward before it is placed on its last
token: DAPO's overlong penalty (``reward_model.overlong_buffer``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_core import overlong_penalty


@dataclass(frozen=True)
class OverlongShaping:
    """Adds ``ppo_core.overlong_penalty`` of each response's length (its generated tokens,
    EOS included) to its reward; ``log``: the step reports the mean penalty and the share
    of responses penalized."""

    max_response_length: int
    buffer_length: int
    penalty_factor: float
    log: bool = False

    def __call__(
        self, rewards: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        penalty = overlong_penalty(
            response_mask.sum(-1), self.max_response_length, self.buffer_length,
            self.penalty_factor,
        ).to(rewards.device)  # fmt: skip
        metrics = {}
        if self.log:
            metrics = {
                "reward/overlong_penalty/mean": float(penalty.mean()),
                "reward/overlong_fraction": float((penalty < 0).float().mean()),
            }
        return rewards + penalty, metrics
