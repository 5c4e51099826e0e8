"""The step's passes, built once from the config (:mod:`klppo_train.trainer.build`).

A :class:`Pass` is a name of :data:`klppo_train.config.roles.PASS_ROLES` and how its micro-batches
are cut: within its role's token budget (the number in force, :class:`RunBudgets`, which the
OOM back-off may halve) or, in verl's static mode, ``micro_batch_size`` sequences at a time.
A :class:`ForwardPass` adds the model and what it computes on the step's samples: response
log-probs (old-log-prob and reference passes) or values (the critic's). The updates are
:class:`klppo_train.workers.trainee.Trainee` objects, each with its update :class:`Pass`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from klppo_train.budgets.run_budgets import RunBudgets, run_with_backoff
from klppo_train.config.roles import PASS_ROLES
from klppo_train.runtime.sequence_parallel import SequenceParallel
from klppo_train.workers.forward import NO_SP, logprob_outputs, response_values
from klppo_train.workers.trajectories import Trajectories

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Pass:
    """One pass of the step: ``name`` (its role: :data:`PASS_ROLES`) and, in verl's static
    mode (``use_dynamic_bsz=false``), its fixed ``micro_batch_size``; None = within the
    role's token budget."""

    name: str
    micro_batch_size: int | None = None

    @property
    def role(self) -> str:
        return PASS_ROLES[self.name]

    def run(
        self,
        budgets: RunBudgets,
        step: int,
        run: Callable[[int], T],
        reset: Callable[[], None] | None = None,
    ) -> T:
        """``run(budget)`` with the role's budget in force, halving it and running again on
        out-of-memory (:func:`klppo_train.budgets.run_budgets.run_with_backoff`)."""
        dynamic = self.micro_batch_size is None
        return run_with_backoff(budgets, self.name, step, run, dynamic=dynamic, reset=reset)


@dataclass(frozen=True, kw_only=True)
class ForwardPass(Pass):
    """A forward-only pass of ``model`` over the responses (``[N, T]`` per token):
    log-probs at the sampling ``temperature`` (and the entropy with ``with_entropy``, Σπ²
    with ``with_sum_pi_squared``), or the critic's values with ``values=True``.
    ``share_prompts``: a prompt's samples run its tokens once per micro-batch
    (``model.share_prompts``); ``sp``: the sequence-parallel group that splits each packed
    row."""

    model: nn.Module
    response_length: int
    share_prompts: bool
    temperature: float = 1.0
    values: bool = False
    with_entropy: bool = False
    with_sum_pi_squared: bool = False
    sp: SequenceParallel = NO_SP

    @torch.no_grad()
    def compute(self, t: Trajectories, budget: int):
        """``values [N, T]``, or the log-probs
        (:class:`~klppo_train.workers.forward.LogProbs`, ``[N, T]`` each), micro-batched
        within ``budget`` tokens (or :attr:`micro_batch_size` sequences)."""
        common = dict(
            max_tokens=budget,
            micro_batch_size=self.micro_batch_size,
            share_prompts=self.share_prompts,
            sp=self.sp,
        )
        if self.values:
            return response_values(
                self.model, t.input_ids, t.attention_mask, self.response_length, **common
            )
        return logprob_outputs(
            self.model,
            t.input_ids,
            t.attention_mask,
            self.response_length,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
            with_sum_pi_squared=self.with_sum_pi_squared,
            **common,
        )

    def __call__(self, t: Trajectories, budgets: RunBudgets, step: int):
        """:meth:`compute` within the role's budget in force, with the OOM back-off."""
        return self.run(budgets, step, lambda budget: self.compute(t, budget))
