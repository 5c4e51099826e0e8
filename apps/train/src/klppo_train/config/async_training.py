"""``async_training``: rollouts generated ahead of the update that trains them (issue 44).

Read once by :class:`klppo_train.trainer.assemble.StepBuilder` into
:class:`klppo_train.ppo.rollouts_ahead.RolloutsAhead`; checked by
:mod:`klppo_train.checks.validate` before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AsyncTrainingConfig:
    """Off-policy by a fixed number of policy versions: at step k the engine generates the
    batch of step k + s with the weights of version k − 1 (the last update's), so a sample
    trained at step k comes from version k − 1 − s exactly (the first s steps' from the
    starting weights: younger). With ``rollout.n`` groups, the old-log-prob pass and rollout
    correction's token TIS (``algorithm.rollout_correction.rollout_is: auto``) this is
    verl's one-step-off / fully-async algorithm with ``s`` steps of staleness."""

    enable: bool = False
    """Generate each step's rollouts ``max_staleness_steps`` steps ahead of training."""
    max_staleness_steps: int | None = None
    """s: how many policy versions a trained sample may lag (null: 1 with ``enable``).
    0 = the synchronous algorithm (the same metrics as ``enable: false``). The batches in
    flight (generated, not yet trained) are saved in each checkpoint, so a resumed run
    trains exactly what an uninterrupted one would (AReaL's ``max_head_offpolicyness``)."""

    rollout_ranks: int = 0
    """R: ranks of the world that hold only the rollout engine and generate while the
    other ranks train (0: every rank does both, taking turns). With R = 1 and s ≥ 1 the
    generating rank samples batch k + s while the training rank updates on batch k; the
    weights stream to it after each update. This version: R = 1, the last rank of the
    launch, with the others training data-parallel (each batch split over them as
    ``trainer.balance_batch`` would); or R beside R training ranks (world size 2R), each
    generating rank serving one."""

    @property
    def lag(self) -> int:
        """s in force (0: synchronous)."""
        if not self.enable:
            return 0
        return 1 if self.max_staleness_steps is None else self.max_staleness_steps
