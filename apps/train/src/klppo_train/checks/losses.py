"""The policy loss's mode against its keys: a key the chosen mode does not read, set away
from its default, is refused (it would take no effect), and bypass mode is chosen one way."""

from __future__ import annotations

from klppo_train.config.schema import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig
from ppo_core import POLICY_LOSS_HYPERPARAMETERS

# The keys of every mode, where they live in the config (actor.* or actor.policy_loss.*).
ACTOR_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
BYPASS = "algorithm.rollout_correction.bypass_mode"


def effective_loss_mode(actor: ActorConfig, correction: RolloutCorrectionConfig) -> str:
    """``bypass_mode`` when rollout correction's bypass is on (verl's ``apply_bypass_mode``
    sets it so), else ``actor.policy_loss.loss_mode``."""
    return "bypass_mode" if correction.bypass_mode else actor.policy_loss.loss_mode


def mode_hyperparameters(actor: ActorConfig, mode: str) -> dict:
    """The chosen mode's own keys and values, read from the config (bypass mode's come from
    ``algorithm.rollout_correction``, which builds them itself: none here)."""
    if mode == "bypass_mode":
        return {}
    return {
        name: getattr(actor if name in ACTOR_KEYS else actor.policy_loss, name)
        for name in POLICY_LOSS_HYPERPARAMETERS[mode]
    }


def _check_value(actor: ActorConfig, name: str):
    # Every mode's keys are read through vars(): only the chosen mode's are *used*
    # (mode_hyperparameters), which is what tests/test_field_usage.py counts.
    return vars(actor if name in ACTOR_KEYS else vars(actor)["policy_loss"])[name]


def _key(name: str) -> str:
    return f"actor.{name}" if name in ACTOR_KEYS else f"actor.policy_loss.{name}"


def check_policy_loss(actor: ActorConfig, correction: RolloutCorrectionConfig) -> None:
    """Raise ``ValueError`` (one line naming the key) when the mode and its keys disagree."""
    chosen = vars(vars(actor)["policy_loss"])["loss_mode"]
    if correction.bypass_mode and chosen not in ("vanilla", "bypass_mode"):
        raise ValueError(
            f"actor.policy_loss.loss_mode={chosen} with {BYPASS}=true: bypass mode has its own "
            "loss (algorithm.rollout_correction.loss_type: ppo_clip or reinforce)"
        )
    if chosen == "bypass_mode" and not correction.bypass_mode:
        raise ValueError(
            f"actor.policy_loss.loss_mode=bypass_mode: set {BYPASS}=true instead (π_old is "
            "then the engine's log-probs and no old-log-prob pass runs, as in verl)"
        )
    mode = "bypass_mode" if correction.bypass_mode else chosen
    used = set(POLICY_LOSS_HYPERPARAMETERS[mode])
    if mode == "bypass_mode" and correction.loss_type == "ppo_clip":
        used |= set(POLICY_LOSS_HYPERPARAMETERS["vanilla"])
    defaults = {**vars(ActorConfig()), **vars(PolicyLossConfig())}
    for name in (*ACTOR_KEYS, *POLICY_LOSS_KEYS):
        if name not in used and _check_value(actor, name) != defaults[name]:
            keys = ", ".join(sorted(used)) or "none"
            raise ValueError(
                f"{_key(name)}={_check_value(actor, name)} takes no effect with "
                f"actor.policy_loss.loss_mode={mode} (its keys: {keys})"
            )
