"""Learning-rate schedules users know from verl: linear warm-up, then constant or cosine."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from klppo_train.config.choices import SCHEDULES


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, kind: str
) -> LambdaLR:
    """A ``LambdaLR`` over :func:`lr_factor` (checkpointable with ``state_dict``)."""
    lr_factor(0, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind)  # validate now
    return LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind),
    )
