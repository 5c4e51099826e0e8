"""Build every component of a run from the config, in one place (constructor injection).

Every model is sharded with ``fsdp_sharding`` (world size 1 included: the same code path
as under torchrun), optimizers are built over the sharded parameters, and each rank gets its
own rollout engine fed by a ``WeightSync`` over the streamed full state dict. The embedded
default (``model.path`` empty) generates its arithmetic data and warms up its tiny model
once, on rank 0, caching both in the run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
)

from fsdp_sharding import ShardingConfig, default_device, iter_full_state_dict, shard_model
from klppo_train.budgets.probe import QUADRATIC_ATTENTION, ProbeShape
from klppo_train.budgets.roles import PASS_ROLES, static_micro_batch_size
from klppo_train.budgets.run_budgets import longest_sequence
from klppo_train.config.schema import AppConfig
from klppo_train.data.datasets import read_rows
from klppo_train.data.rewards import RewardManager
from klppo_train.demo.embedded import build_model, build_tokenizer, warm_up
from klppo_train.ppo.algorithm import KLInReward, make_advantage_fn, make_kl_controller
from klppo_train.ppo.components import Components, StepPlan
from klppo_train.ppo.losses import PolicyLoss, ValueLoss
from klppo_train.ppo.passes import ForwardPass, Pass
from klppo_train.ppo.trainee import Trainee
from klppo_train.runtime.engine import Sampling, build_engine
from klppo_train.runtime.hf_dirs import save_atomically
from klppo_train.runtime.packed_attention import (
    GROUP_ATTENTION,
    compiled_group_attention,
    packed_attention_implementation,
)
from klppo_train.runtime.precision import Precision, resolve_precision, role_sharding
from klppo_train.runtime.process_group import sum_over_ranks, world_size
from klppo_train.trainer.schedule import make_scheduler
from rollout import RolloutEngine, WeightSync

log = logging.getLogger("klppo_train")


def ensure_model_dir(cfg: AppConfig, run_dir: Path) -> Path:
    """The HF directory of the actor: the recipe's, or the embedded model (built, warmed up
    and cached in ``run_dir/model``)."""
    if cfg.model.path:  # checked by preflight
        return Path(cfg.model.path).expanduser()
    path = run_dir / "model"
    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=cfg.trainer.seed)
    rows = read_rows(cfg.data.train_files)
    # Stop on accuracy over training rows the PPO phase will also see (never the val set).
    result = warm_up(
        model,
        tokenizer,
        rows,
        cfg.model.warmup_steps,
        target_accuracy=cfg.model.warmup_target_accuracy,
        eval_rows=rows[-200:],
        seed=cfg.trainer.seed,
    )
    log.info(
        "embedded model: %d supervised warm-up steps, loss %.3f → %.3f, accuracy %.2f",
        result.steps,
        result.losses[0] if result.losses else float("nan"),
        result.losses[-1] if result.losses else float("nan"),
        result.accuracy,
    )
    return save_atomically(model, tokenizer, path)


def make_schedulers(c: Components, cfg: AppConfig, total_steps: int) -> list:
    """Actor: warm-up then constant/cosine; critic: warm-up then constant."""
    schedulers = [
        make_scheduler(
            c.actor.optimizer,
            warmup_steps=cfg.actor.lr_warmup_steps,
            total_steps=total_steps,
            kind=cfg.actor.lr_scheduler,
        )
    ]
    if c.critic is not None:
        schedulers.append(
            make_scheduler(
                c.critic.optimizer,
                total_steps=total_steps,
                warmup_steps=cfg.critic.lr_warmup_steps,
                kind="constant",
            )
        )
    return schedulers


def _sharded(model, fsdp: ShardingConfig, compute: Precision):
    """FSDP with ``compute`` as the forward/backward dtype unless the role's
    ``fsdp.mixed_precision`` says otherwise."""
    return shard_model(model, role_sharding(fsdp, compute.dtype))


COMPILED_BLOCKS = ("MLP", "RMSNorm")


def compile_blocks(model) -> int:
    """``torch.compile`` every module whose class name ends in one of ``COMPILED_BLOCKS``
    (transformers' naming: ``LlamaMLP``, ``Qwen2RMSNorm``, ...), and give every ``*Attention``
    module the compiled packed attention (:func:`compiled_group_attention`); returns how
    many blocks.

    Why these: on CPU their chains of bf16 elementwise ops (norm, SiLU·up, casts; the
    attention's mask, softmax and casts) are most of the non-matmul time, and inductor fuses
    each chain into one kernel (SmolLM2 critic, bf16, 3584 tokens, forward + backward: 4.63 s
    eager → 2.94 s for MLP and RMSNorm). The attention's per-length groups stay Python-level;
    shapes are dynamic, so new micro-batch sizes reuse the compiled code.
    """
    blocks = [m for m in model.modules() if type(m).__name__.endswith(COMPILED_BLOCKS)]
    for block in blocks:
        block.compile(dynamic=True)
    attention = compiled_group_attention()
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            setattr(module, GROUP_ATTENTION, attention)
    return len(blocks)


def _load(cfg: AppConfig, cls, model_dir: Path, dtype: torch.dtype, **kwargs):
    """A HF model with the packed attention the trainer's forward passes use (and its
    blocks compiled when ``model.compile``)."""
    attention = packed_attention_implementation(
        cfg.model.attn_implementation, default_device(), cfg.model.share_prompts
    )
    model = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention, **kwargs)
    if cfg.model.compile:
        log.info("torch.compile: %d blocks of %s", compile_blocks(model), type(model).__name__)
    return model


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the (sharded) parameters, fused: on SmolLM2-135M's fp32 masters on 2 CPU
    cores one step took 0.087 s fused, 0.37 s foreach, 0.76 s with the default loop."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def _values_not_a_view(module, args, output):
    """The value head (``nn.Linear`` over ``[1, nnz, H]``) returns a view of its 2-D matmul,
    and the FSDP2 root returns it as is, which FSDP2 warns about (an in-place op on that
    view would skip its pre-backward hook). A copy of ``[1, nnz, 1]`` values costs nothing.
    Registered before sharding, so it runs before FSDP2's post-forward hook."""
    output.logits = output.logits.clone()
    return output


def _critic(cfg: AppConfig, model_dir: Path, compute: Precision):
    """A value head on the actor's backbone; no dropout (the head defaults to 0.1). The head
    is freshly initialised from the global seed, identically on every rank."""
    critic_config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    critic_config.classifier_dropout = 0.0
    critic = _load(
        cfg, AutoModelForTokenClassification, model_dir, torch.float32, config=critic_config
    )
    critic.register_forward_hook(_values_not_a_view)
    return _sharded(critic, cfg.critic.fsdp, compute)


def _reference(cfg: AppConfig, model_dir: Path, compute: Precision):
    """The frozen reference, stored in the compute dtype (it has no master weights to keep);
    ``None`` when neither KL path (in reward, in loss) reads it."""
    if not (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss):
        log.info("no reference model: algorithm.use_kl_in_reward and actor.use_kl_loss are off")
        return None
    sharding = role_sharding(cfg.ref.fsdp, compute.dtype)
    ref = _load(cfg, AutoModelForCausalLM, model_dir, sharding.mixed_precision.param).eval()
    ref.requires_grad_(False)
    return shard_model(ref, sharding)


def skips_old_log_prob_pass(cfg: AppConfig) -> bool:
    """verl's on-policy shortcut: with one mini-batch and one epoch the policy has not moved
    since it generated, so the update uses logπ_old = sg(logπ) and the old-log-prob pass is
    not run — unless the KL in the reward needs logπ before the update."""
    one_update = (
        cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    )
    return one_update and not cfg.algorithm.use_kl_in_reward


def forward_pass(cfg: AppConfig, name: str, model, **computes) -> ForwardPass:
    """Pass ``name`` of ``model`` over the step's responses, micro-batched as its role says."""
    return ForwardPass(
        name=name,
        micro_batch_size=static_micro_batch_size(cfg, PASS_ROLES[name]),
        model=model,
        response_length=cfg.rollout.sampling.max_new_tokens,
        share_prompts=cfg.model.share_prompts,
        temperature=cfg.rollout.sampling.temperature,
        **computes,
    )


def policy_loss(cfg: AppConfig) -> PolicyLoss:
    a = cfg.actor
    return PolicyLoss(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        temperature=cfg.rollout.sampling.temperature,
        share_prompts=cfg.model.share_prompts,
    )


def value_loss(cfg: AppConfig) -> ValueLoss:
    return ValueLoss(
        cliprange_value=cfg.critic.cliprange_value,
        loss_agg_mode=cfg.critic.loss_agg_mode,
        share_prompts=cfg.model.share_prompts,
    )


def trainee(cfg: AppConfig, name: str, model, loss) -> Trainee:
    """The actor or the critic (``name``: its config section) with its optimizer and
    update pass."""
    section = getattr(cfg, name)
    return Trainee(
        name=name,
        model=model,
        optimizer=adamw(model, section.lr, section.weight_decay),
        loss=loss,
        update=Pass(name=f"update_{name}", micro_batch_size=static_micro_batch_size(cfg, name)),
        epochs=section.ppo_epochs,
        rows_per_mini_batch=section.ppo_mini_batch_size * cfg.rollout.sampling.n // world_size(),
        grad_clip=section.grad_clip,
        offload_optimizer=section.fsdp.optimizer_offload,
        share_prompts=cfg.model.share_prompts,
    )


def build_components(
    cfg: AppConfig, model_dir: Path, tokenizer, rewards: RewardManager
) -> Components:
    """Every component of the run around the checked tokenizer and reward manager; a
    collective (sharding, engine start)."""
    compute = resolve_precision(cfg.model.dtype, default_device())
    actor = _load(cfg, AutoModelForCausalLM, model_dir, torch.float32)  # fp32 master weights
    actor_params = sum(p.numel() for p in actor.parameters())
    actor = _sharded(actor, cfg.actor.fsdp, compute)
    ref = _reference(cfg, model_dir, compute)
    critic = _critic(cfg, model_dir, compute) if cfg.critic.enable else None
    engine = build_engine(cfg, model_dir, tokenizer, compute)
    # Cast while streaming: the engine holds the compute dtype (half the bytes in bf16).
    sync = WeightSync(lambda: iter_full_state_dict(actor), engine, dtype=compute.dtype)
    return assemble(
        cfg, actor=actor, engine=engine, weight_sync=sync, tokenizer=tokenizer,
        rewards=rewards, ref=ref, critic=critic, actor_params=actor_params,
    )  # fmt: skip


def assemble(
    cfg: AppConfig,
    *,
    actor: nn.Module,
    engine: RolloutEngine,
    weight_sync: WeightSync,
    tokenizer,
    rewards: RewardManager,
    ref: nn.Module | None = None,
    critic: nn.Module | None = None,
    actor_params: int = 0,
) -> Components:
    """The step's objects around the run's models (sharded or not): trainees with their
    optimizers and losses, the forward passes that run in this configuration, the resolved
    algorithm choices and the :class:`StepPlan`; the config is not read after this."""
    kl_controller = make_kl_controller(cfg.algorithm)
    critic_trainee = trainee(cfg, "critic", critic, value_loss(cfg)) if critic else None
    return Components(
        actor=trainee(cfg, "actor", actor, policy_loss(cfg)),
        engine=engine,
        weight_sync=weight_sync,
        tokenizer=tokenizer,
        rewards=rewards,
        kl_controller=kl_controller,
        advantage_fn=make_advantage_fn(
            cfg.algorithm, dp_sum=sum_over_ranks if world_size() > 1 else None
        ),
        plan=StepPlan(
            sampling=Sampling.from_config(cfg),
            response_length=cfg.rollout.sampling.max_new_tokens,
            balance_batch=cfg.trainer.balance_batch,
        ),
        kl_in_reward=(
            KLInReward(cfg.algorithm.kl_penalty, kl_controller)
            if cfg.algorithm.use_kl_in_reward
            else None
        ),
        old_log_prob=_old_log_prob_pass(cfg, actor),
        ref=forward_pass(cfg, "ref", ref) if ref is not None else None,
        values=forward_pass(cfg, "values", critic, values=True) if critic else None,
        critic=critic_trainee,
        actor_params=actor_params,
    )


def probe_shape(cfg: AppConfig) -> ProbeShape:
    """What the probe of ``auto`` budgets needs of the config (:mod:`klppo_train.budgets.probe`)."""
    return ProbeShape(
        sequence=longest_sequence(cfg),
        response=cfg.rollout.sampling.max_new_tokens,
        step_rows=cfg.data.train_batch_size * cfg.rollout.sampling.n // world_size(),
        quadratic=cfg.model.attn_implementation in QUADRATIC_ATTENTION,
        memory_limit_gib=cfg.trainer.memory_limit_gib,
        # vLLM's level-2 sleep drops the weights (only a weight sync brings them back)
        engine_sleeps=cfg.rollout.engine != "vllm" or cfg.rollout.vllm.sleep_level == 1,
    )


def _old_log_prob_pass(cfg: AppConfig, actor) -> ForwardPass | None:
    if skips_old_log_prob_pass(cfg):
        log.info(
            "on-policy steps (one mini-batch, actor.ppo_epochs=1, no KL in reward): "
            "logπ_old = sg(logπ) in the update, no old-log-prob pass"
        )
        return None
    return forward_pass(cfg, "old_log_prob", actor, with_entropy=True)
