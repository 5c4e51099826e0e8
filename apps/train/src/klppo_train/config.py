"""The app's configuration: one frozen dataclass per component, composed with OmegaConf.

A run is configured by a YAML recipe plus dotted CLI overrides
(``actor.ppo_max_token_len_per_gpu=16384``). Everything is validated here, before any
model is loaded: unknown keys (with a "did you mean"), types, value ranges, batch-size
divisibility and token budgets. Semantics follow verl where users rely on them:
``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts globally,
``*_per_gpu`` values are per device, ``rollout.n`` samples per prompt.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from klppo_train.data import DataConfig
from klppo_train.verl_names import translate


@dataclass(frozen=True)
class ModelConfig:
    """``path``: a local HF directory; empty = the embedded tiny model of the default recipe."""

    path: str = ""
    # Compute dtype of actor, critic, reference and rollout: float32 | bfloat16 | auto
    # (bf16 on CUDA; on a CPU where a matmul probe shows bf16 faster). klppo_train.precision
    dtype: str = "auto"
    # Attention of the trainer's packed forward passes: auto (flash_attention_2 on CUDA where
    # flash-attn is installed, else klppo_varlen) | klppo_varlen | flash_attention_2 | sdpa
    # (transformers' dense [nnz, nnz] block mask) | eager. klppo_train.attention
    attn_implementation: str = "auto"
    # Embedded model only: supervised warm-up before PPO, at most ``warmup_steps`` steps,
    # stopping once greedy accuracy on training rows reaches ``warmup_target_accuracy``.
    warmup_steps: int = 400
    warmup_target_accuracy: float = 0.25
    gradient_checkpointing: bool = False
    # torch.compile the elementwise-heavy blocks (every *MLP and *RMSNorm module) of actor,
    # critic and reference: one compile of a few seconds per role (identical layers share it).
    compile: bool = False


@dataclass(frozen=True)
class FsdpConfig:
    """Primitive mirror of ``fsdp_sharding.ShardingConfig`` (YAML has no torch dtypes)."""

    strategy: str = "fsdp2"
    # Shard units: these module class names (None = the model's decoder layer), or every
    # module with at least min_num_params parameters not yet in a unit.
    wrap_policy: list[str] | None = None
    min_num_params: int | None = None
    # false | true (1 unit ahead) | a depth >= 1 (FSDP2 prefetches that many units ahead)
    forward_prefetch: Any = False
    backward_prefetch: bool = True
    reshard_after_forward: bool = True
    # Host-memory levers (CUDA only): parameters between uses; FSDP2's CPUOffloadPolicy
    # (parameters, gradients and the optimizer step on CPU); saved activations in forward;
    # the optimizer state between steps.
    param_offload: bool = False
    offload_policy: bool = False
    activation_offload: bool = False
    optimizer_offload: bool = False
    param_dtype: str = ""  # "" = per-device default (bf16 on GPU, fp32 on CPU)
    fsdp_size: int = -1


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 8
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = 4096
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    lr: float = 1e-6
    lr_warmup_steps: int = 0
    lr_scheduler: str = "constant"
    weight_decay: float = 0.01
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass(frozen=True)
class RefConfig:
    # None = as actor.use_dynamic_bsz (verl's default); False = fixed micro-batches of
    # log_prob_micro_batch_size_per_gpu sequences, True = the token budget below.
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_max_token_len_per_gpu: int = 8192
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass(frozen=True)
class CriticConfig:
    enable: bool = True
    ppo_mini_batch_size: int = 8
    use_dynamic_bsz: bool | None = None  # None = as actor.use_dynamic_bsz
    ppo_micro_batch_size_per_gpu: int = 8
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    lr: float = 1e-5
    lr_warmup_steps: int = 0
    weight_decay: float = 0.01
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "vllm"  # "vllm" | "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: int = 512
    # The old-log-prob pass: None = as actor.use_dynamic_bsz; budget or fixed micro-batches.
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_max_token_len_per_gpu: int = 8192
    gpu_memory_utilization: float = 0.5
    kv_cache_space_gib: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # vLLM's per-step token budget (None: its own)
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    enforce_eager: bool = True
    val_temperature: float = 0.0


@dataclass(frozen=True)
class KLControlConfig:
    type: str = "fixed"  # "fixed" | "adaptive"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass(frozen=True)
class RewardConfig:
    custom: str = ""  # "path/to/file.py:function"
    strict: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    total_training_steps: int = 0  # 0 = derive from total_epochs
    total_epochs: int = 1
    run_dir: str = "runs/default"
    seed: int = 1
    test_freq: int = 5
    save_freq: int = 0  # 0 = only at the end
    resume_mode: str = "auto"  # "auto" | "disable" | a checkpoint path
    max_ckpt_to_keep: int = 2
    # Stop after this step (checkpointing it), keeping the schedule of total_training_steps:
    # for jobs longer than one allocation; the next launch resumes. 0 = run to the end.
    stop_at_step: int = 0
    val_before_train: bool = True  # validate the starting policy (step 0)
    # auto: tcmalloc when the system has it (the command line re-executes itself with it
    # preloaded; ~18 % off a CPU step), else malloc | tcmalloc (required) | system
    allocator: str = "auto"
    # verl's launch shape, checked against torchrun's WORLD_SIZE (0 = not checked).
    n_gpus_per_node: int = 0
    nnodes: int = 0


@dataclass(frozen=True)
class AppConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


PATH_LISTS = ("data.train_files", "data.val_files")


def _unknown_key(key: str) -> str | None:
    """None for a key of the schema (a field, or a whole section), else the error text with
    a "did you mean" and the valid keys under its parent."""
    node: Any = AppConfig
    parent = ""
    for part in key.split("."):
        valid = {f.name: f for f in fields(node)} if is_dataclass(node) else {}
        if part not in valid:
            close = difflib.get_close_matches(part, list(valid), n=1)
            where = f"{parent}." if parent else ""
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            return (
                f"unknown config key '{key}'{hint} (valid under '{parent or '<top>'}': "
                f"{', '.join(valid)})"
            )
        factory = valid[part].default_factory
        node = factory if factory is not MISSING else None
        parent = f"{parent}.{part}" if parent else part
    return None


def _flatten(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and (node or not prefix):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _translated_layer(container: dict, errors: list[str]) -> DictConfig:
    """One config layer (recipe or overrides) with verl's names translated; every unknown
    or refused key goes to ``errors`` (all of them, not the first)."""
    layer = OmegaConf.create()
    for key, value in _flatten(container):
        pairs, refusal = translate(key, value)
        if refusal:
            errors.append(refusal)
        for name, item in pairs:
            if name in PATH_LISTS and isinstance(item, str):
                item = [item]  # verl's `data.train_files=/path/train.parquet`
            problem = _unknown_key(name)
            if problem:
                errors.append(problem)
            else:
                OmegaConf.update(layer, name, item, merge=True)
    return layer


def _read_recipe(recipe: str | Path) -> dict:
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(recipe), resolve=False)
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"recipe {str(recipe)!r}: {err}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"recipe {str(recipe)!r}: not a mapping of config sections")
    return loaded


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> AppConfig:
    """Schema defaults ← YAML recipe ← dotted overrides (klppo's or verl's names), type-checked.

    Raises:
        ValueError: one line naming every unknown or refused key, or the first bad value.
    """
    errors: list[str] = []
    layers = [_translated_layer(_read_recipe(recipe), errors)] if recipe is not None else []
    try:
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as err:
        raise ValueError(f"bad command-line override: {err}") from None
    layers.append(_translated_layer(dotlist, errors))
    if errors:
        raise ValueError("; ".join(errors))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(AppConfig), *layers)
    except ValidationError as err:
        raise ValueError(f"bad value for config key '{err.full_key}': {err.msg}") from None
    return _follow_actor_dynamic_bsz(OmegaConf.to_object(merged))


def _follow_actor_dynamic_bsz(cfg: AppConfig) -> AppConfig:
    """verl's defaults: the critic's, reference's and rollout's ``use_dynamic_bsz`` switches
    follow ``actor.use_dynamic_bsz`` unless set."""
    mode = cfg.actor.use_dynamic_bsz

    def follow(section, key):
        return section if getattr(section, key) is not None else replace(section, **{key: mode})

    return replace(
        cfg,
        critic=follow(cfg.critic, "use_dynamic_bsz"),
        ref=follow(cfg.ref, "log_prob_use_dynamic_bsz"),
        rollout=follow(cfg.rollout, "log_prob_use_dynamic_bsz"),
    )


def to_yaml(config: AppConfig) -> str:
    """The resolved config as YAML (``--print-config``, and the copy in the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
