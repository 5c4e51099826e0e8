"""Everything a PPO step touches, built once by :mod:`klppo_train.build` and passed in.

Choices (advantage estimator, KL controller, engine, reward manager) are resolved once,
at build time, into the objects held here; the step never looks a name up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from klppo_train.algorithm import AdvantageFn
from klppo_train.budgets import RunBudgets
from klppo_train.rewards import RewardManager
from ppo_core import AdaptiveKLController, FixedKLController
from rollout import RolloutEngine, WeightSync


@dataclass
class Components:
    """The run's models, optimizers, engine and resolved choices (constructor injection).

    ``ref`` is None without a KL path, ``critic``/``critic_optimizer`` without a critic.
    ``budgets``: the token budgets in force (set before step 0: the config's numbers, the
    probe's choice for ``auto``, or a checkpoint's). ``timings`` collects
    ``timing_s/<stage>`` of the current step.
    """

    actor: nn.Module
    actor_optimizer: torch.optim.Optimizer
    engine: RolloutEngine
    weight_sync: WeightSync
    tokenizer: Any  # a HF tokenizer (any class: the embedded one is a plain fast tokenizer)
    rewards: RewardManager
    kl_controller: FixedKLController | AdaptiveKLController
    advantage_fn: AdvantageFn
    ref: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    actor_params: int = 0  # of the full (unsharded) actor: the step's FLOP estimate
    budgets: RunBudgets | None = None
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def timed(c: Components, stage: str) -> Iterator[None]:
    """Record the wall time of the block as ``c.timings["timing_s/<stage>"]``."""
    start = time.perf_counter()
    yield
    c.timings[f"timing_s/{stage}"] = time.perf_counter() - start
