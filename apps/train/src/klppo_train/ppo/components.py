"""Everything a PPO step touches, built once by :mod:`klppo_train.trainer.build` and passed in.

Choices (advantage estimator, KL controller, engine, reward manager, which passes run) are
resolved once, at build time, into the objects held here; the step never looks a name or
a config key up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from klppo_train.agents.samplers import Sampler
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.config.roles import ROLES
from klppo_train.data.rewards import RewardManager
from klppo_train.ppo.algorithm import AdvantageFn, KLInReward
from klppo_train.ppo.rollout_correction import RolloutCorrection
from klppo_train.ppo.rollouts import RolloutSource, StepPlan
from klppo_train.ppo.shaping import OverlongShaping
from klppo_train.reward_model.serve import RewardModelReward
from klppo_train.workers.passes import ForwardPass
from klppo_train.workers.trainee import Trainee
from ppo_core import AdaptiveKLController, FixedKLController
from rollout import RolloutEngine, WeightPublisher


@dataclass
class Components:
    """The run's trainees, passes, engine and resolved choices (constructor injection).

    ``rollouts``: where the steps' trajectories come from and the new weights go (the
    colocated ``engine`` and ``weight_sync`` today; validation reads the engine directly).
    ``old_log_prob`` is None in rollout correction's bypass mode (π_old = π_rollout);
    ``on_policy_shortcut``: the configuration allows skipping it (one mini-batch, one epoch,
    no KL in the reward, no decoupled correction: logπ_old = sg(logπ)), which a step does
    only for samples of the weights it trains (:func:`klppo_train.ppo.step.train_on`);
    ``ref`` without a KL path; ``values``/``critic``
    without a critic; ``kl_in_reward`` without ``algorithm.use_kl_in_reward`` (the
    controller is kept either way: it is checkpointed); ``reward_model`` without
    ``reward_model.enable`` (rule rewards only). ``budgets``: the token budgets in
    force (set before step 0: the config's numbers, the probe's choice for ``auto``, or a
    checkpoint's). ``rollout_correction`` without ``algorithm.rollout_correction``.
    """

    actor: Trainee
    engine: RolloutEngine
    sampler: Sampler  # the engine's single turn or conversations with tools (validation's too)
    weight_sync: WeightPublisher
    rollouts: RolloutSource
    tokenizer: Any  # a HF tokenizer (any class: the embedded one is a plain fast tokenizer)
    rewards: RewardManager
    kl_controller: FixedKLController | AdaptiveKLController
    advantage_fn: AdvantageFn
    plan: StepPlan
    kl_in_reward: KLInReward | None = None
    old_log_prob: ForwardPass | None = None
    on_policy_shortcut: bool = False
    ref: ForwardPass | None = None
    values: ForwardPass | None = None
    critic: Trainee | None = None
    reward_model: RewardModelReward | None = None
    update_flops_per_token: float = 0.0  # the actor update's: 6 per trained parameter, 4 per frozen
    budgets: RunBudgets | None = None
    export_actor: Callable[..., Any] | None = None  # (run_dir, suffix="") → the HF export(s)
    rollout_correction: RolloutCorrection | None = None  # algorithm.rollout_correction
    shaping: OverlongShaping | None = None  # reward_model.overlong_buffer

    def trainees(self) -> list[Trainee]:
        return [t for t in (self.actor, self.critic) if t is not None]

    def pass_for(self, role: str) -> ForwardPass | Trainee | None:
        """What the probe measures for ``role`` (its most demanding pass,
        ``ROLES[role].probed_pass``), or None when that pass does not run here."""
        name = ROLES[role].probed_pass
        scoring = self.reward_model.scoring_pass if self.reward_model is not None else None
        old = None if self.on_policy_shortcut else self.old_log_prob  # on-policy: not run
        forward = [p for p in (old, self.ref, self.values, scoring) if p]
        updates = [t for t in self.trainees() if t.update.name == name]
        return next((p for p in forward if p.name == name), updates[0] if updates else None)

    def models(self) -> list[nn.Module]:
        """The trained models (actor, then critic)."""
        return [t.model for t in self.trainees()]
