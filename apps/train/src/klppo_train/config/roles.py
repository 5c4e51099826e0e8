"""The one table of the run's token-budget roles and of the passes that run within them.

A *role* owns a per-device token budget (a key that takes a number or ``auto``) and the
switch between that budget and verl's fixed micro-batch sizes. A *pass* is one forward or
update pass of a step; it runs within its role's budget. Everything that lists roles or
passes (the budgets, the probe, the OOM fault hook, the config checks) reads this table:
adding a model worker is adding a row here and building its pass.

====================================== ======== ========================== ================
budget key                             role     passes                     probed pass
====================================== ======== ========================== ================
``actor.ppo_max_token_len_per_gpu``    actor    update_actor               update_actor
``critic.ppo_max_token_len_per_gpu``   critic   values, update_critic      update_critic
``ref.log_prob_max_token_len_per_gpu`` ref      ref                        ref
``rollout.log_prob_max_token_len_...`` rollout  old_log_prob               old_log_prob
``reward_model.forward_max_token_...`` reward_  reward_model               reward_model
                                       model
``reward_training.max_token_len_...``  reward_  update_reward_model        update_reward_model
                                       training (trainer.task=reward_model only)
====================================== ======== ========================== ================

This module holds names only (no torch, no config import): the checks that run before any
model loads read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"
"""A budget key's value that has the probe measure the budget (klppo_train.trainer.probe)."""


@dataclass(frozen=True)
class Role:
    """A token-budget owner: its three config keys and the pass the probe measures for it
    (its most demanding one)."""

    name: str
    budget_key: str  # tokens per micro-batch, or auto
    dynamic_key: str  # verl's use_dynamic_bsz: false = fixed micro-batch sizes
    micro_batch_key: str  # sequences per micro-batch when not dynamic
    probed_pass: str
    task: str = "ppo"  # the trainer.task whose runs have this role


ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role(
            "actor",
            "actor.ppo_max_token_len_per_gpu",
            "actor.use_dynamic_bsz",
            "actor.ppo_micro_batch_size_per_gpu",
            "update_actor",
        ),
        Role(
            "critic",
            "critic.ppo_max_token_len_per_gpu",
            "critic.use_dynamic_bsz",
            "critic.ppo_micro_batch_size_per_gpu",
            "update_critic",
        ),
        Role(
            "ref",
            "ref.log_prob_max_token_len_per_gpu",
            "ref.log_prob_use_dynamic_bsz",
            "ref.log_prob_micro_batch_size_per_gpu",
            "ref",
        ),
        Role(
            "rollout",
            "rollout.log_prob_max_token_len_per_gpu",
            "rollout.log_prob_use_dynamic_bsz",
            "rollout.log_prob_micro_batch_size_per_gpu",
            "old_log_prob",
        ),
        Role(
            "reward_model",
            "reward_model.forward_max_token_len_per_gpu",
            "reward_model.use_dynamic_bsz",
            "reward_model.micro_batch_size_per_gpu",
            "reward_model",
        ),
        Role(
            "reward_training",
            "reward_training.max_token_len_per_gpu",
            "reward_training.use_dynamic_bsz",
            "reward_training.micro_batch_size_per_gpu",
            "update_reward_model",
            task="reward_model",
        ),
    )
}

# Each pass of a step and the role whose budget it runs within.
PASS_ROLES: dict[str, str] = {
    "old_log_prob": "rollout",
    "ref": "ref",
    "values": "critic",
    "update_actor": "actor",
    "update_critic": "critic",
    "reward_model": "reward_model",
    "update_reward_model": "reward_training",
}


def task_roles(task: str) -> list[str]:
    """The roles of ``trainer.task``'s runs."""
    return [name for name, role in ROLES.items() if role.task == task]


def run_roles(cfg: Any) -> list[str]:
    """The roles whose budgets this run has: its task's (the reward model's only when
    ``reward_model.enable``)."""
    roles = task_roles(cfg.trainer.task)
    return [r for r in roles if r != "reward_model" or cfg.reward_model.enable]


def config_value(cfg: Any, key: str) -> Any:
    """The value of a dotted key (``actor.use_dynamic_bsz``) of the app's config."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def uses_budget(cfg: Any, role: str) -> bool:
    """Whether the role's passes are cut by its budget (``use_dynamic_bsz``, True or not
    resolved), not by a fixed number of sequences."""
    return config_value(cfg, ROLES[role].dynamic_key) is not False


def static_micro_batch_size(cfg: Any, role: str) -> int | None:
    """The fixed micro-batch size of verl's static mode (``use_dynamic_bsz=false``), or None
    for token-budget micro-batches."""
    if uses_budget(cfg, role):
        return None
    return config_value(cfg, ROLES[role].micro_batch_key)


def longest_sequence(cfg: Any) -> int:
    """The rule's minimum: a micro-batch must hold one prompt + response of full length (a
    reward-model run: one pair, two of them)."""
    if cfg.trainer.task == "reward_model":
        return 2 * (cfg.data.max_prompt_length + cfg.reward_training.max_response_length)
    return cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
