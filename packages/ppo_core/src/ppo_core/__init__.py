"""klppo-ppo-core: pure-tensor PPO math (torch only).

Plain functions with explicit arguments, so they drop into any training loop:

- masked ops: :func:`masked_mean`, :func:`masked_sum`, :func:`masked_var`, :func:`masked_whiten`
  (whole-batch statistics under data parallelism with ``dp_sum``, :data:`SumOverRanks`)
- logits: :func:`logprobs_and_entropy`, :func:`logprobs_from_logits`, :func:`entropy_from_logits`
- KL: :func:`kl_penalty`, :func:`apply_kl_penalty`, :class:`FixedKLController`,
  :class:`AdaptiveKLController`
- advantages: :func:`compute_gae`, :func:`compute_grpo_advantages`,
  :func:`compute_rloo_advantages`, :func:`compute_reinforce_pp_advantages`
- losses: :func:`aggregate_loss`, :func:`policy_loss`, :func:`value_loss`
- rewards: :func:`token_level_scores` (a sequence's score on its last response token),
  :func:`pairwise_reward_loss` (a reward model's Bradley–Terry loss)
"""

from importlib.metadata import PackageNotFoundError, version

from ppo_core.advantages import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
)
from ppo_core.kl import KL_ESTIMATORS, apply_kl_penalty, kl_penalty
from ppo_core.kl_control import AdaptiveKLController, FixedKLController
from ppo_core.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from ppo_core.losses import (
    LOSS_AGG_MODES,
    SHARE_METRICS,
    aggregate_loss,
    policy_loss,
    value_loss,
)
from ppo_core.masked import SumOverRanks, masked_mean, masked_sum, masked_var, masked_whiten
from ppo_core.rewards import pairwise_reward_loss, token_level_scores

try:
    __version__ = version("klppo-ppo-core")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "SHARE_METRICS",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "SumOverRanks",
    "pairwise_reward_loss",
    "policy_loss",
    "token_level_scores",
    "value_loss",
]
