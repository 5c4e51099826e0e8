"""klppo-ppo-core: pure-tensor PPO math (torch only).

Plain functions with explicit arguments, so they drop into any training loop:

- masked ops: :func:`masked_mean`, :func:`masked_sum`, :func:`masked_var`, :func:`masked_whiten`
  (whole-batch statistics under data parallelism with ``dp_sum``, :data:`SumOverRanks`)
- logits: :func:`logprobs_and_entropy`, :func:`logprobs_from_logits`, :func:`entropy_from_logits`,
  :func:`sum_pi_squared_from_logits`
- KL: :func:`kl_penalty`, :func:`apply_kl_penalty`, :class:`FixedKLController`,
  :class:`AdaptiveKLController`
- advantages: :func:`compute_gae`, :func:`compute_grpo_advantages`,
  :func:`compute_rloo_advantages`, :func:`compute_reinforce_pp_advantages`,
  :func:`compute_grpo_passk_advantages`, :func:`compute_reinforce_pp_baseline_advantages`,
  :func:`compute_opo_advantages`, :func:`compute_gpg_advantages`,
  :func:`compute_remax_advantages`, :func:`compute_optimal_token_baseline_advantages`;
  every verl name: :data:`ADVANTAGE_ESTIMATORS`
- losses: :func:`aggregate_loss`, :func:`policy_loss` (any of verl's ``loss_mode`` names:
  :data:`POLICY_LOSSES`), :func:`clipped_policy_loss` (``vanilla``), :func:`gspo_loss`,
  :func:`sapo_loss`, :func:`gpg_loss`, :func:`clip_cov_loss`, :func:`kl_cov_loss`,
  :func:`geo_mean_loss`, :func:`cispo_loss`, :func:`bypass_mode_loss`,
  :func:`reinforce_loss`, :func:`value_loss`
- rollout correction (the engine's π_rollout vs the trainer's π_old):
  :func:`rollout_is_weights` (token/sequence TIS), :func:`normalize_is_weights`,
  :func:`rejection_mask` (:func:`rejection_rules`), :func:`off_policy_metrics`
- rewards: :func:`token_level_scores` (a sequence's score on its last response token),
  :func:`overlong_penalty` (DAPO's soft overlong punishment),
  :func:`pairwise_reward_loss` (a reward model's Bradley–Terry loss)
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("klppo-ppo-core")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# name → the submodule that defines it, imported on first use (PEP 562): a caller that
# needs one torch-free name (a config check) does not pay for torch.
_EXPORTS = {
    "IS_LEVELS": "options",
    "KL_ESTIMATORS": "options",
    "LOSS_AGG_MODES": "options",
    "RS_OPTIONS": "options",
    "RejectionRule": "options",
    "SHARE_METRICS": "losses",
    "AdaptiveKLController": "kl_control",
    "FixedKLController": "kl_control",
    "aggregate_loss": "losses",
    "apply_kl_penalty": "kl",
    "compute_gae": "advantages",
    "ADVANTAGE_ESTIMATORS": "estimators",
    "ADVANTAGE_ESTIMATOR_NAMES": "options",
    "compute_grpo_passk_advantages": "group_advantages",
    "compute_reinforce_pp_baseline_advantages": "group_advantages",
    "compute_opo_advantages": "group_advantages",
    "compute_gpg_advantages": "group_advantages",
    "compute_remax_advantages": "group_advantages",
    "compute_optimal_token_baseline_advantages": "token_baseline",
    "compute_grpo_advantages": "advantages",
    "compute_reinforce_pp_advantages": "advantages",
    "compute_rloo_advantages": "advantages",
    "entropy_from_logits": "logits",
    "sum_pi_squared_from_logits": "logits",
    "kl_penalty": "kl",
    "logprobs_and_entropy": "logits",
    "logprobs_from_logits": "logits",
    "masked_mean": "masked",
    "masked_sum": "masked",
    "masked_var": "masked",
    "masked_whiten": "masked",
    "normalize_is_weights": "rollout_correction",
    "off_policy_metrics": "rollout_correction",
    "SumOverRanks": "masked",
    "pairwise_reward_loss": "rewards",
    "overlong_penalty": "rewards",
    "policy_loss": "policy_losses",
    "POLICY_LOSSES": "policy_losses",
    "POLICY_LOSS_MODES": "options",
    "POLICY_LOSS_HYPERPARAMETERS": "options",
    "SEQUENCE_MEAN_MODES": "options",
    "clipped_policy_loss": "losses",
    "gspo_loss": "policy_losses",
    "sapo_loss": "policy_losses",
    "gpg_loss": "policy_losses",
    "geo_mean_loss": "policy_losses",
    "cispo_loss": "policy_losses",
    "bypass_mode_loss": "policy_losses",
    "clip_cov_loss": "cov_losses",
    "kl_cov_loss": "cov_losses",
    "reinforce_loss": "losses",
    "rejection_mask": "rollout_correction",
    "rejection_rules": "options",
    "rollout_is_weights": "rollout_correction",
    "token_level_scores": "rewards",
    "value_loss": "losses",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = list(_EXPORTS)
