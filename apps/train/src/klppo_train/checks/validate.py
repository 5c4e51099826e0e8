"""Cross-field checks of an :class:`AppConfig`, run before any model or data is loaded.

Every error names the config key(s) at fault. Returns the non-fatal findings (token-budget
advice) for the caller to log.
"""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path

from batching import check_token_budgets
from fsdp_sharding import has_manifest, verify_manifest  # fsdp_sharding.manifest: no torch
from klppo_train.checks.losses import check_policy_loss
from klppo_train.config.choices import (
    ADV_ESTIMATORS,
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    GROUP_ESTIMATORS,
    SCHEDULES,
    TOKEN_BASELINE_ESTIMATORS,
    VARLEN,
)
from klppo_train.config.roles import AUTO, ROLES, longest_sequence, run_roles, uses_budget
from klppo_train.config.schema import (
    AlgorithmConfig,
    AppConfig,
    AsyncTrainingConfig,
    DataConfig,
    FilterGroupsConfig,
    ModelConfig,
    MultiTurnSection,
    OverlongBufferConfig,
    RewardModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from klppo_train.data import sources
from klppo_train.runtime.allocator import check_allocator
from klppo_train.tracking.backends import check_loggers
from ppo_core import IS_LEVELS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_MODES, rejection_rules

CHOICES = {
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor.policy_loss.loss_mode": POLICY_LOSS_MODES,
    "critic.loss_agg_mode": LOSS_AGG_MODES,
    "actor.kl_loss_type": KL_ESTIMATORS,
    "actor.lr_scheduler": SCHEDULES,
    "rollout.engine": ("vllm", "hf"),
    "model.dtype": DTYPES,
    "model.attn_implementation": ATTN_IMPLEMENTATIONS,
    "trainer.task": ("ppo", "reward_model"),
    "reward_model.retemplate": ("auto", "always", "never"),
    "reward_model.normalize": ("none", "stored", "reference"),
    "reward_model.combine": ("rm", "rule", "sum"),
    "reward_model.ensemble.reduce": ("min", "mean"),
    "reward_training.lr_scheduler": SCHEDULES,
}


def _choices() -> dict[str, tuple[str, ...]]:
    """:data:`CHOICES` and the sources registered now (:mod:`klppo_train.data.sources`)."""
    return {
        **CHOICES,
        "model.source": ("", *sources.MODEL_SOURCES),
        "data.source": ("", *sources.DATA_SOURCES, *sources.PREFERENCE_SOURCES),
    }


def _get(config: AppConfig, key: str):
    """A dotted key's value; its own function, not ``roles.config_value``: reads made here
    are checks, which ``tests/test_field_usage.py`` does not count as the key's use."""
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _positive_counts(cfg: AppConfig) -> list[tuple[str, bool, str]]:
    """Sizes, counts and budgets: zero or negative ones fail late (a ZeroDivisionError, a
    step without any update, a crash in step 1) or silently do nothing."""
    keys = [
        "actor.ppo_mini_batch_size",
        "actor.ppo_micro_batch_size_per_gpu",
        "actor.ppo_epochs",
        "critic.ppo_mini_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.ppo_epochs",
        "ref.log_prob_micro_batch_size_per_gpu",
        "rollout.log_prob_micro_batch_size_per_gpu",
        "trainer.total_epochs",
        "reward_model.micro_batch_size_per_gpu",
        "reward_model.normalize_samples",
        "reward_training.max_response_length",
    ]
    return [(key, _get(cfg, key) >= 1, ">= 1") for key in keys]


# Keys that must be >= 0 (counts where 0 means "off" / "all", coefficients, warm-ups).
NON_NEGATIVE = {
    "actor.weight_decay": ">= 0",
    "critic.weight_decay": ">= 0",
    "actor.lr_warmup_steps": ">= 0",
    "critic.lr_warmup_steps": ">= 0",
    "actor.kl_loss_coef": ">= 0",
    "actor.entropy_coeff": ">= 0",
    "algorithm.kl_ctrl.kl_coef": ">= 0",
    "rollout.val_temperature": ">= 0",
    "model.warmup_steps": ">= 0",
    "model.lora_rank": ">= 0 (0 = full fine-tuning)",
    "critic.lora_rank": ">= 0 (0 = full fine-tuning)",
    "trainer.total_training_steps": ">= 0 (0 = epochs)",
    "trainer.test_freq": ">= 0",
    "trainer.save_freq": ">= 0",
    "trainer.max_ckpt_to_keep": ">= 0 (0 = keep all)",
    "trainer.stop_at_step": ">= 0",
    "trainer.log_val_generations": ">= 0 (0 = none)",
    "trainer.n_gpus_per_node": ">= 0 (0 = not checked)",
    "trainer.nnodes": ">= 0 (0 = not checked)",
    "trainer.memory_limit_gib": ">= 0 (0 = from the free memory)",
    "reward_model.clip_range": ">= 0 (0 = no clipping)",
    "reward_model.missing_eos_penalty": ">= 0 (0 = none)",
    "reward_training.weight_decay": ">= 0",
    "reward_training.lr_warmup_steps": ">= 0",
    "reward_training.center_rewards_coefficient": ">= 0",
}
# Keys that must be > 0.
POSITIVE = (
    "trainer.collective_timeout_s",
    "actor.lr",
    "critic.lr",
    "critic.cliprange_value",
    "algorithm.kl_ctrl.target_kl",
    "algorithm.kl_ctrl.horizon",
    "reward_training.lr",
    "model.lora_alpha",
    "critic.lora_alpha",
)
FLIPS = "> 0 (a negative norm flips the gradient)"


def _check_ranges(cfg: AppConfig) -> None:
    rules = _positive_counts(cfg) + [
        *((key, _get(cfg, key) >= 0, rule) for key, rule in NON_NEGATIVE.items()),
        *((key, _get(cfg, key) > 0, "> 0") for key in POSITIVE),
        ("actor.grad_clip", cfg.actor.grad_clip > 0, FLIPS),
        ("critic.grad_clip", cfg.critic.grad_clip > 0, FLIPS),
        ("reward_training.grad_clip", cfg.reward_training.grad_clip > 0, FLIPS),
        (
            "reward_training.micro_batch_size_per_gpu",
            _get(cfg, "reward_training.micro_batch_size_per_gpu") % 2 == 0
            and _get(cfg, "reward_training.micro_batch_size_per_gpu") >= 2,
            "an even number >= 2 (whole pairs)",
        ),
        ("actor.clip_ratio_low", 0 < cfg.actor.clip_ratio_low < 1, "in (0, 1)"),
        ("actor.clip_ratio_high", 0 < cfg.actor.clip_ratio_high < 1, "in (0, 1)"),
        ("actor.clip_ratio_c", cfg.actor.clip_ratio_c > 1, "> 1"),
        ("algorithm.gamma", 0 <= cfg.algorithm.gamma <= 1, "in [0, 1]"),
        ("algorithm.lam", 0 <= cfg.algorithm.lam <= 1, "in [0, 1]"),
        (
            "model.warmup_target_accuracy",
            0 <= cfg.model.warmup_target_accuracy <= 1,
            "in [0, 1]",
        ),
    ]
    for key, ok, rule in rules:
        if not ok:
            raise ValueError(f"{key} must be {rule}, got {_get(cfg, key)!r}")
    for key, allowed in _choices().items():
        if _get(cfg, key) not in allowed:
            raise ValueError(f"{key}={_get(cfg, key)!r}; valid: {', '.join(allowed)}")
    attention = cfg.model.attn_implementation
    if cfg.model.share_prompts and attention not in ("auto", VARLEN):
        raise ValueError(
            f"model.share_prompts=true needs model.attn_implementation={VARLEN} (or auto), got "
            f"{attention!r}: only it can attend over a shared prompt; set model.share_prompts=false"
        )


def _check_budget_values(cfg: AppConfig) -> None:
    """Each budget is a number of tokens >= 1 or ``auto`` (which needs a pass that is cut
    by tokens: with fixed micro-batch sizes the budget is not read)."""
    for role in (ROLES[name] for name in run_roles(cfg)):
        key = role.budget_key
        value = _get(cfg, key)
        if isinstance(value, str):
            if value != AUTO:
                raise ValueError(f"{key}={value!r}; valid: a number of tokens >= 1, or auto")
            if not uses_budget(cfg, role.name):
                raise ValueError(
                    f"{key}=auto with {role.dynamic_key}=false: fixed micro-batch sizes do "
                    "not use a token budget"
                )
        elif value < 1:
            raise ValueError(f"{key} must be >= 1, got {value!r}")


def _check_gen_batch_size(data: DataConfig, dynamic: bool, world_size: int) -> None:
    """verl trains on the whole generation batch unless dynamic sampling picks from it."""
    gen, batch = data.gen_batch_size, data.train_batch_size
    if gen is None or gen == batch:
        return
    if not dynamic:
        raise ValueError(
            f"data.gen_batch_size={gen} takes effect only with algorithm.filter_groups."
            "enable=true (dynamic sampling keeps data.train_batch_size of each round's "
            "groups); without it every generated prompt is trained on: set "
            "data.train_batch_size instead"
        )
    if gen % world_size:
        raise ValueError(
            f"data.gen_batch_size={gen} prompts do not split evenly over {world_size} ranks"
        )


def _check_batch_sizes(cfg: AppConfig, world_size: int) -> None:
    n = cfg.rollout.sampling.n
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic.enable else [])
    batch = cfg.data.train_batch_size
    if batch % world_size:
        # Unequal shares would give the ranks different numbers of micro-batches and
        # optimizer steps (FSDP collectives that never pair up).
        raise ValueError(
            f"data.train_batch_size={batch} prompts do not split evenly over {world_size} "
            "ranks (each rank generates for an equal share, whole groups of rollout.n)"
        )
    _check_gen_batch_size(cfg.data, cfg.algorithm.filter_groups.enable, world_size)
    for role, section in roles:
        if batch % section.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={batch} is not divisible "
                f"by {role}.ppo_mini_batch_size={section.ppo_mini_batch_size}"
            )
        samples = section.ppo_mini_batch_size * n
        if samples % world_size:
            raise ValueError(
                f"{role}.ppo_mini_batch_size × rollout.n = {samples} samples do not "
                f"split over {world_size} ranks"
            )
        per_gpu = samples // world_size
        micro = section.ppo_micro_batch_size_per_gpu
        if section.use_dynamic_bsz is False and per_gpu % micro:
            raise ValueError(
                f"{role}: {per_gpu} samples per rank per mini-batch are not "
                f"divisible by {role}.ppo_micro_batch_size_per_gpu={micro}"
            )


def _check_kl_control(cfg: AppConfig) -> None:
    ctl = cfg.algorithm.kl_ctrl
    if ctl.type != "adaptive" or not cfg.algorithm.use_kl_in_reward:
        return
    if ctl.kl_coef <= 0:
        raise ValueError(
            "algorithm.kl_ctrl.kl_coef must be > 0 with kl_ctrl.type=adaptive (the controller "
            f"multiplies it: 0 stays 0), got {ctl.kl_coef}"
        )
    samples = cfg.data.train_batch_size * cfg.rollout.sampling.n
    if samples >= 5 * ctl.horizon:
        raise ValueError(
            f"algorithm.kl_ctrl.horizon={ctl.horizon:g} is too small for {samples} samples per "
            "step (data.train_batch_size × rollout.n): it must exceed samples / 5, or one "
            "step could drive the KL coefficient to 0"
        )


def _check_launch(trainer: TrainerConfig, world_size: int) -> None:
    gpus, nodes = trainer.n_gpus_per_node, trainer.nnodes
    if (gpus or nodes) and gpus * max(nodes, 1) != world_size:
        raise ValueError(
            f"trainer.n_gpus_per_node={gpus} × trainer.nnodes={nodes} is not the launch's "
            f"world size {world_size} (torchrun --nproc-per-node × --nnodes)"
        )


def _check_fsdp_sizes(cfg: AppConfig, world_size: int) -> None:
    if cfg.ref.fsdp.optimizer_offload:
        raise ValueError("ref.fsdp.optimizer_offload=true: the reference has no optimizer")
    for role in ("actor", "critic", "reward_training"):
        fsdp = getattr(cfg, role).fsdp
        if fsdp.strategy == "fsdp1" and fsdp.param_offload:
            raise ValueError(
                f"{role}.fsdp.param_offload=true with strategy=fsdp1: FSDP1's CPUOffload gives "
                "incorrect gradients under gradient accumulation (torch documents it); use "
                f"{role}.fsdp.strategy=fsdp2 with {role}.fsdp.offload_policy=true"
            )
    if cfg.reward_model.fsdp.optimizer_offload:
        raise ValueError("reward_model.fsdp.optimizer_offload=true: the reward model is frozen")
    offloads = ("param_offload", "offload_policy", "activation_offload", "optimizer_offload")
    for role in SHARDED:
        for key in offloads:
            if getattr(getattr(cfg, role).fsdp, key) and not _on_cuda():
                raise ValueError(
                    f"{role}.fsdp.{key}=true only takes effect on CUDA (it moves tensors to "
                    "host memory; here they are there already)"
                )
    for role in SHARDED:
        size = getattr(cfg, role).fsdp.fsdp_size
        if size != -1 and (size < 1 or world_size % size):
            raise ValueError(
                f"{role}.fsdp.fsdp_size={size} must be -1 (all ranks) or divide the world "
                f"size {world_size}"
            )


SHARDED = ("actor", "ref", "critic", "reward_model", "reward_training")
SP = "ulysses_sequence_parallel_size"


def sequence_parallel_size(cfg: AppConfig) -> int:
    """The run's Ulysses size (``actor.ulysses_sequence_parallel_size``; 1 for the reward
    model task, which has none)."""
    return cfg.actor.ulysses_sequence_parallel_size if cfg.trainer.task == "ppo" else 1


def _check_sequence_parallel(cfg: AppConfig, world_size: int) -> None:
    """One size for the run, dividing the world; what a split row needs: the packed
    attention, no shared prompts (heads: :mod:`klppo_train.checks.preflight`). An unset
    ``model.share_prompts`` is off here already (``schema.load_config``); true was set."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp < 1 or world_size % sp:
        raise ValueError(f"actor.{SP}={sp} must be >= 1 and divide the world size {world_size}")
    for role in ("ref", "critic"):
        own = getattr(cfg, role).ulysses_sequence_parallel_size
        if own is not None and own != sp:
            raise ValueError(
                f"{role}.{SP}={own} differs from actor.{SP}={sp}: klppo runs one size for "
                "the run (leave it unset: it follows the actor's)"
            )
    if sp == 1 or cfg.trainer.task != "ppo":
        return
    if cfg.model.share_prompts:
        raise ValueError(
            f"model.share_prompts=true with actor.{SP}={sp}: a split row cannot share "
            "prompt tokens; set model.share_prompts=false (or leave it unset)"
        )
    if cfg.model.attn_implementation not in ("auto", VARLEN):
        raise ValueError(
            f"actor.{SP}={sp} needs model.attn_implementation={VARLEN} (or auto), got "
            f"{cfg.model.attn_implementation!r}: only it exchanges the heads of a split row"
        )


def _check_overlong_buffer(buf: OverlongBufferConfig, limit: int) -> None:
    """DAPO's overlong penalty: a buffer within the response length (``limit``), and no key
    set without ``enable``."""
    key = "reward_model.overlong_buffer"
    if not buf.enable:
        default = type(buf)()
        for name in ("len", "penalty_factor", "log"):
            if getattr(buf, name) != getattr(default, name):
                raise ValueError(f"{key}.{name} takes effect only with {key}.enable=true")
        return
    if not 0 < buf.len <= limit:
        raise ValueError(f"{key}.len={buf.len}: want 0 < len <= rollout.response_length={limit}")
    if buf.penalty_factor < 0:
        raise ValueError(f"{key}.penalty_factor={buf.penalty_factor}: want >= 0")


def _check_reward_model(cfg: AppConfig) -> None:
    """The reward model's switches (its directory is checked with the data, before any model
    loads: :mod:`klppo_train.checks.preflight`)."""
    _check_overlong_buffer(cfg.reward_model.overlong_buffer, cfg.rollout.sampling.max_new_tokens)
    rm = cfg.reward_model
    if rm.enable and not (rm.path or rm.source):
        raise ValueError("reward_model.enable=true needs reward_model.path (or a .source recipe)")
    if not rm.enable and rm.combine != "rm":
        raise ValueError(
            f"reward_model.combine={rm.combine!r} with reward_model.enable=false: there is no "
            "reward-model score to combine"
        )
    if rm.ensemble.reduce != "min" and not rm.ensemble.paths:
        raise ValueError(
            "reward_model.ensemble.reduce takes effect only with reward_model.ensemble.paths"
        )
    if rm.ensemble.paths and not rm.enable:
        raise ValueError(
            "reward_model.ensemble.paths with reward_model.enable=false: no reward model to join"
        )
    if rm.source and not Path(rm.source).expanduser().is_file():
        raise ValueError(f"reward_model.source={rm.source!r}: no such recipe file")


def _check_reward_training(cfg: AppConfig, world_size: int) -> None:
    """A reward-model run: whole pairs per rank, and a budget that holds one pair."""
    batch = cfg.data.train_batch_size
    if batch % world_size:
        raise ValueError(
            f"data.train_batch_size={batch} pairs do not split evenly over {world_size} ranks"
        )
    budget = _get(cfg, ROLES["reward_training"].budget_key)
    pair = longest_sequence(cfg)
    if budget != AUTO and uses_budget(cfg, "reward_training") and budget < pair:
        raise ValueError(
            f"reward_training.max_token_len_per_gpu={budget} cannot hold one pair of "
            f"{pair} tokens (2 × (data.max_prompt_length + "
            "reward_training.max_response_length))"
        )


def _check_algorithm(cfg: AppConfig) -> None:
    _check_kl_control(cfg)
    _check_rollout_correction(cfg)
    check_policy_loss(cfg.actor, cfg.algorithm.rollout_correction)
    _check_filter_groups(cfg.algorithm.filter_groups, cfg.reward_model, cfg.rollout.sampling.n)
    estimator = cfg.algorithm.adv_estimator
    if estimator in TOKEN_BASELINE_ESTIMATORS or cfg.actor.calculate_sum_pi_squared:
        _check_sum_pi_squared(cfg.algorithm, cfg.rollout.sampling.n)
    if estimator == "remax":
        _check_remax(cfg.algorithm.filter_groups, cfg.reward_model)
    if estimator == "gae" and not cfg.critic.enable:
        raise ValueError("algorithm.adv_estimator=gae needs a critic: set critic.enable=true")
    if estimator in GROUP_ESTIMATORS and cfg.rollout.sampling.n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={estimator} compares samples of one prompt: "
            f"rollout.n must be >= 2, got {cfg.rollout.sampling.n}"
        )


def _check_sum_pi_squared(algorithm: AlgorithmConfig, n: int) -> None:
    """Σπ² comes from the old-log-prob pass; the optimal token baseline reads it and weighs
    a prompt's ``n`` responses against each other."""
    estimator = algorithm.adv_estimator
    if estimator not in TOKEN_BASELINE_ESTIMATORS:
        estimator = ""
    if algorithm.rollout_correction.bypass_mode:
        who = (
            f"algorithm.adv_estimator={estimator}"
            if estimator
            else "actor.calculate_sum_pi_squared"
        )
        raise ValueError(
            f"{who} needs Σπ² from the old-log-prob pass, which "
            "algorithm.rollout_correction.bypass_mode skips: turn one of them off"
        )
    if estimator and n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={estimator} is a baseline over a prompt's samples: "
            f"rollout.n must be >= 2, got {n}"
        )


FILTER_METRICS = ("acc", "score", "seq_reward")


def _check_filter_groups(fg: FilterGroupsConfig, rm: RewardModelConfig, n: int) -> None:
    """DAPO's dynamic sampling scores each generation round with the rule reward; its keys
    take effect only when it is on."""
    key = "algorithm.filter_groups"
    if fg.enable and n < 2:
        raise ValueError(
            f"{key}.enable=true with rollout.n={n}: a group of one sample is always kept, "
            "so nothing would be filtered"
        )
    if fg.metric == "seq_final_reward":
        raise ValueError(
            f"{key}.metric=seq_final_reward is not run by klppo: the reward after the KL "
            "penalty needs the reference's pass on every generated sample, dropped ones too "
            "(use seq_reward)"
        )
    if fg.metric not in FILTER_METRICS:
        raise ValueError(f"{key}.metric={fg.metric!r}; valid: {', '.join(FILTER_METRICS)}")
    if fg.max_num_gen_batches < 0:
        raise ValueError(f"{key}.max_num_gen_batches must be >= 0 (0 = no limit)")
    if not fg.enable:
        for name in ("metric", "max_num_gen_batches"):
            if getattr(fg, name) != getattr(FilterGroupsConfig(), name):
                raise ValueError(f"{key}.{name} takes effect only with {key}.enable=true")
    if fg.enable and rm.enable and rm.combine != "rule":
        raise ValueError(
            f"{key}.enable=true with reward_model.combine={rm.combine}: the groups are "
            "filtered on the rule reward, not on a reward model's score (use combine=rule)"
        )


def _check_remax(fg: FilterGroupsConfig, rm: RewardModelConfig) -> None:
    """ReMax's baseline is the rule reward of a greedy answer, one more rollout source."""
    if fg.enable:
        raise ValueError(
            "algorithm.adv_estimator=remax with algorithm.filter_groups.enable=true: the "
            "greedy baselines and dynamic sampling do not run together yet"
        )
    if rm.enable and rm.combine != "rule":
        raise ValueError(
            f"algorithm.adv_estimator=remax with reward_model.combine={rm.combine}: the "
            "greedy answer's baseline is scored by the rule reward, not by a reward model "
            "(use combine=rule)"
        )


def _check_multi_turn(mt: MultiTurnSection) -> None:
    """Tools are what a multi-turn rollout is for (the tool config itself is loaded by the
    preflight, with the data); its keys take effect only when it is on."""
    key = "rollout.multi_turn"
    if mt.enable and not mt.tool_config_path:
        raise ValueError(
            f"{key}.enable=true needs {key}.tool_config_path (verl's tool-config YAML, "
            "e.g. tools: [{class_name: calculator, ...}])"
        )
    if not mt.enable:
        for f in fields(MultiTurnSection):
            if f.name != "enable" and getattr(mt, f.name) != getattr(MultiTurnSection(), f.name):
                raise ValueError(f"{key}.{f.name} takes effect only with {key}.enable=true")


def _check_rollout_correction(cfg: AppConfig) -> None:
    """``algorithm.rollout_correction``: known names, parseable bounds, and no key set that
    would take no effect."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if rc.rollout_is is not None and rc.rollout_is not in IS_LEVELS:
        raise ValueError(f"{key}.rollout_is={rc.rollout_is!r}; valid: {', '.join(IS_LEVELS)}")
    if not rc.rollout_is_threshold > 0:
        raise ValueError(f"{key}.rollout_is_threshold must be > 0, got {rc.rollout_is_threshold}")
    default = type(rc)()
    if rc.rollout_is is None:
        for name in ("rollout_is_threshold", "rollout_is_batch_normalize"):
            if getattr(rc, name) != getattr(default, name):
                raise ValueError(f"{key}.{name} takes effect only with {key}.rollout_is set")
    if rc.rollout_rs is not None:
        try:
            rejection_rules(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as err:
            raise ValueError(f"{key}.{err}") from None
    elif rc.rollout_rs_threshold is not None:
        raise ValueError(f"{key}.rollout_rs_threshold takes effect only with {key}.rollout_rs")
    if rc.loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"{key}.loss_type={rc.loss_type!r}; valid: ppo_clip, reinforce")
    if rc.loss_type != default.loss_type and not rc.bypass_mode:
        raise ValueError(f"{key}.loss_type takes effect only with {key}.bypass_mode=true")


def _check_async_training(
    at: AsyncTrainingConfig, trainer: TrainerConfig, bypass: bool, rollout: RolloutConfig
) -> None:
    """``async_training``: a staleness bound ≥ 0 that takes effect, and the old-log-prob
    pass it needs (π_old = the trainer's weights: samples of older weights are off-policy;
    ``bypass``: rollout correction's bypass mode takes the engine's)."""
    key, s = "async_training", at.max_staleness_steps
    if not at.enable:
        if s is not None:
            raise ValueError(f"{key}.max_staleness_steps takes effect only with {key}.enable=true")
        return
    if trainer.task != "ppo":
        raise ValueError(f"{key}.enable: trains PPO only, not trainer.task={trainer.task}")
    if trainer.val_only:
        raise ValueError(f"{key}.enable takes effect only in training, not trainer.val_only")
    if s is not None and (isinstance(s, bool) or s < 0):
        raise ValueError(f"{key}.max_staleness_steps must be an int >= 0, got {s!r}")
    if at.lag and bypass:
        raise ValueError(
            f"{key}.max_staleness_steps={at.lag} with algorithm.rollout_correction.bypass_mode"
            ": stale samples need π_old from the trainer's weights (the old-log-prob pass), "
            "bypass mode takes the engine's"
        )
    if at.lag and rollout.engine == "vllm" and rollout.vllm.sleep_level == 2:
        raise ValueError(
            f"{key}: the first steps' batches are generated ahead across an engine sleep, "
            "which rollout.vllm.sleep_level=2 empties of its weights: use sleep_level=1"
        )


def _check_rollout_ranks(at: AsyncTrainingConfig, world_size: int, rm: bool, sp: int) -> None:
    """``async_training.rollout_ranks``: ranks of their own for the engine (this version:
    one of them beside any number of data-parallel training ranks, or as many of them as
    training ranks; rule rewards)."""
    key, r = "async_training.rollout_ranks", at.rollout_ranks
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"{key} must be an int >= 0, got {r!r}")
    if not r:
        return
    if not at.enable:
        raise ValueError(f"{key}={r} takes effect only with async_training.enable=true")
    if r >= world_size:
        raise ValueError(
            f"{key}={r} leaves no training rank in the launch's world size {world_size} "
            "(torchrun --nproc-per-node × --nnodes)"
        )
    if r != 1 and 2 * r != world_size:
        raise ValueError(
            f"{key}={r} at world size {world_size}: this version runs one generating rank "
            f"beside any number of training ranks, or as many of each ({key}={world_size // 2}"
            " at an even world size)"
        )
    refused = {
        "reward_model.enable (its scores are computed where it is sharded)": rm,
        "actor.ulysses_sequence_parallel_size > 1 (the generating rank splits each batch "
        "over data-parallel ranks only)": sp > 1,
    }
    for what, on in refused.items():
        if on:
            raise ValueError(f"{key}={r} with {what}: not supported yet (rollout_ranks=0 is)")


def _check_token_budgets(cfg: AppConfig) -> list[str]:
    """The budgets' rules, for the passes that use one (``use_dynamic_bsz``)."""
    # Passes with fixed micro-batch sizes do not read their budget; auto budgets are chosen
    # later (never below one sequence) and stand in with values that raise no finding.
    static = {
        role.budget_key
        for role in ROLES.values()
        if not uses_budget(cfg, role.name) or _get(cfg, role.budget_key) == AUTO
    }

    def number(key: str, stand_in: int) -> int:
        return stand_in if _get(cfg, key) == AUTO else _get(cfg, key)

    def findings(log_prob_key: str) -> list[tuple[str, str]]:
        keys = {
            "actor": ROLES["actor"].budget_key,
            "log_prob": log_prob_key,
            "critic": ROLES["critic"].budget_key,
        }
        found = check_token_budgets(
            cfg.data.max_prompt_length,
            cfg.rollout.sampling.max_new_tokens,
            actor=number(keys["actor"], longest_sequence(cfg)),
            log_prob=number(log_prob_key, 2**40),
            critic=number(keys["critic"], 2**40),
        )
        return [
            (f.level, f"{keys[f.key]}: {f.message}") for f in found if keys[f.key] not in static
        ]

    # The old-log-prob pass runs on the rollout's budget, the reference pass on the ref's:
    # all findings for the first, the log-prob ones for the second.
    ref_key = ROLES["ref"].budget_key
    messages = findings(ROLES["rollout"].budget_key)
    messages += [m for m in findings(ref_key) if m[1].startswith(ref_key)]
    errors = [text for level, text in messages if level == "error"]
    if errors:
        raise ValueError("; ".join(errors))
    return [text for _, text in messages]


def _check_compiler(model: ModelConfig) -> None:
    """``model.compile`` builds C++ kernels (inductor) on CPU: without a compiler it would
    fail at the first forward, after every model loaded."""
    if not model.compile:
        return
    from torch._inductor import cpp_builder, exc  # imported only when asked: ~1 s

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as err:
        raise ValueError(
            "model.compile=true needs a C++ compiler for torch.compile (inductor): none "
            "found (install g++ or set CXX)"
        ) from err


def _check_best(trainer: TrainerConfig) -> None:
    """The metric's name here; whether this run's validation has it: preflight (the data)."""
    metric = trainer.best_metric
    if metric != "auto" and not metric.startswith("val/"):
        raise ValueError(
            f"trainer.best_metric={metric!r}: 'auto' or a validation metric (val/<source>/acc, "
            "val/reward_model/score, val/rm/accuracy, ...)"
        )
    if metric != "auto" and trainer.export_best and not trainer.test_freq:
        raise ValueError(f"trainer.best_metric={metric!r} needs validation: trainer.test_freq is 0")


def _check_resume(trainer: TrainerConfig) -> None:
    mode = trainer.resume_mode
    first = "actor" if trainer.task == "ppo" else "reward_model"
    if mode in ("auto", "disable"):
        return
    path = Path(mode).expanduser()
    if not (path / first).is_dir():
        raise ValueError(
            f"trainer.resume_mode={mode!r}: not 'auto', 'disable' or a checkpoint directory "
            f"(run_dir/checkpoints/global_step_<N>, with a{'n' * (first == 'actor')} "
            f"{first}/ inside)"
        )
    problem = verify_manifest(path) if has_manifest(path) else None
    if problem is not None:
        raise ValueError(f"trainer.resume_mode={mode!r}: the checkpoint is damaged: {problem}")


def _check_val_only(cfg: AppConfig) -> None:
    """trainer.val_only: a PPO policy, validation data, a numeric reward-model budget (no
    probe runs), and the training run's reward normalization where it is ``reference``."""
    if cfg.trainer.task != "ppo":
        raise ValueError("trainer.val_only=true validates a policy: only with trainer.task=ppo")
    if not cfg.data.val_files:
        raise ValueError("trainer.val_only=true: data.val_files is empty (nothing to validate)")
    rm = cfg.reward_model
    if rm.enable and rm.forward_max_token_len_per_gpu == AUTO and rm.use_dynamic_bsz:
        raise ValueError(
            "trainer.val_only=true: reward_model.forward_max_token_len_per_gpu=auto is not "
            "probed in a validation-only run; give a number"
        )
    checkpoint = cfg.trainer.resume_mode not in ("auto", "disable")
    stats = Path(cfg.trainer.run_dir).expanduser() / "reward_normalization.json"
    if rm.enable and rm.normalize == "reference" and not checkpoint and not stats.is_file():
        raise ValueError(
            "trainer.val_only=true with reward_model.normalize=reference reads the training "
            f"run's statistics: no {stats} (set trainer.run_dir to that run, name one of its "
            "checkpoints in trainer.resume_mode, or use normalize=stored/none)"
        )


def _check_lora(cfg: AppConfig) -> None:
    """LoRA (actor, critic) needs peft, a target, FSDP2, and the PPO task (the reward
    model trains in full)."""
    for key, section, fsdp in (
        ("model", cfg.model, cfg.actor.fsdp),
        ("critic", cfg.critic, cfg.critic.fsdp),
    ):
        if section.lora_rank:
            _check_lora_section(cfg, key, section, fsdp)
    if cfg.model.lora_rank and cfg.ref.fsdp != type(cfg.ref)().fsdp:
        raise ValueError(
            "ref.fsdp.* takes no effect with model.lora_rank > 0: the reference is the actor "
            "with its adapters off (actor.fsdp.* shard it)"
        )


def _check_lora_section(cfg: AppConfig, key: str, section, fsdp) -> None:
    role = "actor" if key == "model" else "critic"
    if importlib.util.find_spec("peft") is None:
        raise ValueError(
            f"{key}.lora_rank={section.lora_rank} needs peft: pip install 'klppo-train[lora]' "
            "(or uv sync --extra lora)"
        )
    if not section.target_modules:
        raise ValueError(f"{key}.target_modules is empty: name the adapted layers, or all-linear")
    if fsdp.strategy != "fsdp2":
        raise ValueError(
            f"{key}.lora_rank needs {role}.fsdp.strategy=fsdp2: FSDP1 flattens a unit into one "
            "dtype (no bf16 base beside fp32 adapters) and its state-dict hooks fail on "
            "peft's layers (torch 2.13)"
        )
    if cfg.trainer.task == "reward_model":
        raise ValueError(
            f"{key}.lora_rank applies to the PPO {role}; trainer.task=reward_model trains the "
            f"whole reward model: set {key}.lora_rank=0"
        )


def validate_config(config: AppConfig, world_size: int = 1) -> list[str]:
    """Raise ``ValueError`` naming the key(s) of the first problem; return advice to log."""
    _check_ranges(config)
    _check_budget_values(config)
    _check_resume(config.trainer)
    _check_best(config.trainer)
    _check_launch(config.trainer, world_size)
    _check_compiler(config.model)
    check_allocator(config.trainer.allocator)
    check_loggers(config.trainer.logger)
    _check_lora(config)
    bypass = config.algorithm.rollout_correction.bypass_mode
    _check_async_training(config.async_training, config.trainer, bypass, config.rollout)
    _check_rollout_ranks(
        config.async_training, world_size, config.reward_model.enable,
        config.actor.ulysses_sequence_parallel_size,
    )  # fmt: skip
    world_size -= config.async_training.rollout_ranks  # the training ranks, from here on
    _check_fsdp_sizes(config, world_size)
    if config.trainer.val_only:
        _check_val_only(config)
    if config.trainer.task == "reward_model":
        _check_reward_training(config, world_size)
        return []
    _check_reward_model(config)
    _check_multi_turn(config.rollout.multi_turn)
    _check_algorithm(config)
    _check_sequence_parallel(config, world_size)
    # The sp ranks of a group hold the same samples: the data splits over the rest.
    _check_batch_sizes(config, world_size // config.actor.ulysses_sequence_parallel_size)
    advice = _epochs_advice(config.algorithm.filter_groups, config.trainer)
    return _check_token_budgets(config) + advice


def _epochs_advice(fg: FilterGroupsConfig, trainer: TrainerConfig) -> list[str]:
    """Dynamic sampling consumes a loader batch per generation round, so a run measured in
    epochs (steps = epochs × batches an epoch) passes over the data more often."""
    if not fg.enable or trainer.total_training_steps:
        return []
    return [
        "algorithm.filter_groups with trainer.total_epochs: the run takes total_epochs × "
        "(batches an epoch) steps and each step may generate several batches, so it sees "
        "the data more often than total_epochs says (trainer.total_training_steps bounds "
        "the steps)"
    ]


def _on_cuda() -> bool:
    """Whether the run's device is a GPU: asked only when an offload key is set, since it
    loads torch (the other checks run without it)."""
    from fsdp_sharding import default_device

    return default_device().type == "cuda"
