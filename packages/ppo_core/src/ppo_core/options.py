"""The names ppo_core's functions accept, without torch: a trainer checks its
configuration (``algorithm.kl_penalty``, ``actor.loss_agg_mode``) before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

KL_BASE_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
"""Schulman's estimators and verl's names for them (``kl``=k1, ``mse``=k2, ``low_var_kl``=k3)."""

KL_ESTIMATORS: tuple[str, ...] = KL_BASE_ESTIMATORS + tuple(f"{n}+" for n in KL_BASE_ESTIMATORS)
"""Every name :func:`ppo_core.kl_penalty` accepts (``+``: the straight-through variant)."""

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Every ``mode`` :func:`ppo_core.aggregate_loss` accepts."""

POLICY_LOSS_MODES = (
    "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "bypass_mode",
)  # fmt: skip
"""Every ``loss_mode`` :func:`ppo_core.policy_loss` accepts (verl's registered names)."""

_CLIP = ("clip_ratio_low", "clip_ratio_high")
POLICY_LOSS_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "vanilla": (*_CLIP, "clip_ratio_c"),
    "gspo": _CLIP,
    "sapo": ("tau_pos", "tau_neg"),
    "gpg": (),
    "clip_cov": (*_CLIP, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "geo_mean": _CLIP,
    "cispo": _CLIP,
    "bypass_mode": ("loss_type", "rollout_is", "rollout_is_threshold",
                    "rollout_is_batch_normalize", "rollout_rs"),
}  # fmt: skip
"""Each ``loss_mode``'s own hyperparameters (verl's names; besides the aggregation keywords,
``is_weights`` and clip_cov's ``generator``): a trainer checks its configuration against them
without torch."""

SEQUENCE_MEAN_MODES = ("gspo", "sapo")
"""Modes verl aggregates ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says."""

ADVANTAGE_ESTIMATOR_NAMES = (
    "gae", "grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized", "opo", "gpg",
    "optimal_token_baseline", "tir_optimal_token_baseline",
)  # fmt: skip
"""Every advantage estimator verl registers (:data:`ppo_core.ADVANTAGE_ESTIMATORS`)."""

IS_LEVELS = ("token", "sequence")
"""Every ``level`` of :func:`ppo_core.rollout_is_weights` (verl's ``rollout_is``)."""

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""Every rejection-sampling option (verl's ``rollout_rs``): where the statistic is taken
(each token, or a sequence's sum, mean or max) and which divergence (k1, k2, k3)."""


@dataclass(frozen=True)
class RejectionRule:
    """One rejection-sampling option and its bounds. ``k1`` options keep
    ``log(lower) ≤ stat ≤ log(upper)``; ``k2``/``k3`` options keep ``stat ≤ upper``
    (``lower`` is ``None``)."""

    option: str
    upper: float
    lower: float | None = None


def _one_rule(option: str, spec: float | str) -> RejectionRule:
    where = f"rollout_rs_threshold {spec!r} for {option}"
    if option.endswith("_k1"):
        text = str(spec)
        parts = text.split("_") if "_" in text else [None, text]
        try:  # one part each side of "_", or one number
            upper = float(parts[1])
            lower = 1.0 / upper if parts[0] is None else float(parts[0])
        except (ValueError, ZeroDivisionError, IndexError):
            raise ValueError(f"{where}: want 'lower_upper' or one number > 0") from None
        if len(parts) != 2 or not 0 < lower < upper:
            raise ValueError(f"{where}: want 0 < lower < upper")
        return RejectionRule(option, upper, lower)
    try:
        if "_" in str(spec):  # float() reads "0.5_2" as 0.52
            raise ValueError
        upper = float(spec)
    except ValueError:
        raise ValueError(f"{where}: want one number > 0 (k2/k3 have no lower bound)") from None
    if not upper > 0:
        raise ValueError(f"{where}: want a number > 0")
    return RejectionRule(option, upper)


def rejection_rules(options: str, thresholds: float | str | None) -> tuple[RejectionRule, ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` pair as rules: ``options`` is a comma
    list of :data:`RS_OPTIONS` (a token must pass all of them); ``thresholds`` one value for
    all of them or one per option, comma-separated. A ``k1`` threshold is ``"lower_upper"``
    or one number ``u`` (= ``"1/u_u"``). Raises ``ValueError`` naming what is wrong."""
    names = [o.strip() for o in options.split(",") if o.strip()]
    if not names or any(o not in RS_OPTIONS for o in names):
        raise ValueError(f"rollout_rs {options!r}: options are {', '.join(RS_OPTIONS)}")
    if thresholds is None:
        raise ValueError(f"rollout_rs {options!r} needs rollout_rs_threshold")
    specs = [s.strip() for s in str(thresholds).split(",")]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold {thresholds!r}: one value, or one per option ({len(names)})"
        )
    return tuple(_one_rule(o, s) for o, s in zip(names, specs, strict=True))
