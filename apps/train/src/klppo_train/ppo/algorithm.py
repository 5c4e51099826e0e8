"""Rewards → advantages, as the config's algorithm section says (all math from ``ppo_core``).

Order (verl's): optional KL penalty in the reward (``use_kl_in_reward``, with the fixed or
adaptive controller), then the advantage estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from klppo_train.config.choices import ADV_ESTIMATORS
from klppo_train.config.schema import AlgorithmConfig
from klppo_train.runtime.process_group import dp_size, sum_over_ranks
from ppo_core import (
    AdaptiveKLController,
    FixedKLController,
    SumOverRanks,
    apply_kl_penalty,
    compute_gae,
    compute_gpg_advantages,
    compute_grpo_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_optimal_token_baseline_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    masked_mean,
    masked_var,
)


def make_kl_controller(cfg: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    ctl = cfg.kl_ctrl
    if ctl.type == "adaptive":
        return AdaptiveKLController(ctl.kl_coef, ctl.target_kl, ctl.horizon)
    return FixedKLController(ctl.kl_coef)


@dataclass(frozen=True)
class KLInReward:
    """r = s − β·KL(π_old ‖ π_ref) per token (``algorithm.kl_penalty`` estimator), β from the
    controller, which then moves by the whole batch's KL (the mean over all data-parallel
    ranks, which hold equal numbers of samples; n_steps = all their samples), so every rank
    keeps the same β."""

    penalty: str
    controller: FixedKLController | AdaptiveKLController

    def __call__(
        self,
        token_scores: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rewards, metrics = apply_kl_penalty(
            token_scores,
            old_logprobs,
            ref_logprobs,
            response_mask,
            self.controller.value,
            self.penalty,
        )
        ranks = dp_size()  # each holds its share of the batch (the sp ranks of a group: one)
        kl = sum_over_ranks(metrics["kl"].detach().float()) / ranks
        self.controller.update(kl, n_steps=token_scores.shape[0] * ranks)
        return rewards, {
            "actor/reward_kl_penalty": float(kl),
            "actor/reward_kl_penalty_coeff": float(metrics["kl_coef"]),
        }


# (token_rewards, response_mask, **inputs) -> (advantages, returns), all [N, T]; the
# keywords are AdvantageInputs' fields.
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvantageInputs:
    """What estimators read besides the rewards and the mask, None where the step has none:
    ``values`` ``[N, T]`` (the critic's), ``group_ids`` ``[N]`` (the prompt of each sample),
    ``baselines`` ``[N]`` (ReMax's greedy rewards), ``old_logprobs`` and ``sum_pi_squared``
    ``[N, T]`` (the old-log-prob pass's), ``is_weights`` ``[N, T]`` (rollout correction's)."""

    values: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    baselines: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    def need(self, estimator: str, name: str, what: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"algorithm.adv_estimator={estimator} needs {what}")
        return value


def _sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_rewards * response_mask).sum(-1)


def _estimators(cfg: AlgorithmConfig, dp_sum: SumOverRanks | None) -> dict[str, Callable]:
    """Each estimator as ``fn(rewards, mask, inputs: AdvantageInputs)``; GRPO/RLOO score
    each sequence by its summed token rewards and group the samples of one prompt by
    ``group_ids`` (whole on one rank); GAE and REINFORCE++ whiten over every rank's samples
    through ``dp_sum``."""
    prompts = "the prompt index of each sample"

    def grouped(name: str, fn, **kw):
        return lambda r, m, x: fn(
            _sequence_scores(r, m), x.need(name, "group_ids", prompts), m, **kw
        )

    def token_baseline(name: str, by_token_count: bool):
        def run(r, m, x):
            what = "Σπ² and log π_old from the old-log-prob pass"
            return compute_optimal_token_baseline_advantages(
                r, x.need(name, "group_ids", prompts), m, x.need(name, "old_logprobs", what),
                x.need(name, "sum_pi_squared", what), x.is_weights,
                by_token_count=by_token_count, handle_zero_tail=by_token_count,
            )  # fmt: skip

        return run

    norm = cfg.norm_adv_by_std_in_grpo
    return {
        "gae": lambda r, m, x: compute_gae(
            r, x.need("gae", "values", "critic values"), m, cfg.gamma, cfg.lam, dp_sum=dp_sum
        ),
        "grpo": grouped("grpo", compute_grpo_advantages, norm_by_std=norm),
        "grpo_vectorized": grouped("grpo_vectorized", compute_grpo_advantages, norm_by_std=norm),
        "grpo_passk": grouped("grpo_passk", compute_grpo_passk_advantages, norm_by_std=norm),
        "rloo": grouped("rloo", compute_rloo_advantages),
        "rloo_vectorized": grouped("rloo_vectorized", compute_rloo_advantages),
        "reinforce_plus_plus": lambda r, m, x: compute_reinforce_pp_advantages(
            r, m, cfg.gamma, dp_sum=dp_sum
        ),
        "reinforce_plus_plus_baseline": grouped(
            "reinforce_plus_plus_baseline", compute_reinforce_pp_baseline_advantages, dp_sum=dp_sum
        ),
        "opo": grouped("opo", compute_opo_advantages),
        "gpg": grouped("gpg", compute_gpg_advantages, dp_sum=dp_sum),
        "remax": lambda r, m, x: compute_remax_advantages(
            r, x.need("remax", "baselines", "the greedy responses' rewards"), m
        ),
        "optimal_token_baseline": token_baseline("optimal_token_baseline", False),
        "tir_optimal_token_baseline": token_baseline("tir_optimal_token_baseline", True),
    }


if tuple(_estimators(AlgorithmConfig(), None)) != ADV_ESTIMATORS:  # the checks' list
    raise ImportError("klppo_train.config.choices.ADV_ESTIMATORS names other estimators")


def make_advantage_fn(cfg: AlgorithmConfig, dp_sum: SumOverRanks | None = None) -> AdvantageFn:
    """``cfg.adv_estimator`` resolved once (build time) to its function
    ``fn(token_rewards, response_mask, **inputs) -> (advantages, returns)``, ``[N, T]``
    each; ``inputs``: :class:`AdvantageInputs`' fields by name. ``dp_sum`` (an all-reduce)
    under data parallelism."""
    estimators = _estimators(cfg, dp_sum)
    if cfg.adv_estimator not in estimators:
        raise ValueError(
            f"algorithm.adv_estimator={cfg.adv_estimator!r}; valid: {', '.join(estimators)}"
        )
    estimator = estimators[cfg.adv_estimator]
    return lambda rewards, mask, **inputs: estimator(rewards, mask, AdvantageInputs(**inputs))


def advantage_metrics(
    advantages: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    valid = response_mask.bool()
    return {
        "critic/advantages/mean": float(masked_mean(advantages, response_mask)),
        "critic/advantages/max": float(advantages[valid].max()) if valid.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, response_mask)),
    }


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """``critic/vf_explained_var`` = 1 − Var(returns − values) / Var(returns) over the valid
    tokens of every rank (1: the critic predicts the returns; 0: no better than their mean)."""
    var_returns = masked_var(returns, response_mask, unbiased=False, dp_sum=sum_over_ranks)
    errors = returns - values
    var_error = masked_var(errors, response_mask, unbiased=False, dp_sum=sum_over_ranks)
    return float(1.0 - var_error / (var_returns + 1e-8))
