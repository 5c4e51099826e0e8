"""Build every component of a run from the config, in one place (constructor injection).

Every model is sharded with ``fsdp_sharding`` (world size 1 included: the same code path
as under torchrun), optimizers are built over the sharded parameters, and each rank gets its
own rollout engine fed by a ``WeightSync`` over the streamed full state dict. (The embedded
default's model is prepared with the run directory: :mod:`klppo_train.loop.run_dir`.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
)

from batching import compiled_group_attention
from fsdp_sharding import (
    ShardingConfig,
    default_device,
    export_hf,
    iter_full_state_dict,
    shard_model,
)
from klppo_train.checks.validate import sequence_parallel_size
from klppo_train.config.schema import AppConfig
from klppo_train.data.rewards import RewardManager
from klppo_train.ppo.components import Components
from klppo_train.reward_model.export import scalar_head_config
from klppo_train.reward_model.hf_dir import is_reward_model_dir
from klppo_train.runtime.engine import build_engine
from klppo_train.runtime.lora import Lora, WithoutAdapters, export_lora, lora_of
from klppo_train.runtime.packed_attention import GROUP_ATTENTION, packed_attention_implementation
from klppo_train.runtime.precision import Precision, resolve_precision, role_sharding
from klppo_train.runtime.process_group import rollout_link
from klppo_train.trainer.assemble import StepBuilder
from rollout import AdapterSync, StreamedEngine, Tool, WeightSync

log = logging.getLogger("klppo_train")


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


def attention_implementation(cfg: AppConfig, device: torch.device) -> str:
    """``model.attn_implementation`` resolved: ``auto`` takes ``klppo_varlen`` where only it
    runs the packed rows (shared prompts, rows split by sequence parallelism)."""
    needs_varlen = cfg.model.share_prompts or sequence_parallel_size(cfg) > 1
    return packed_attention_implementation(cfg.model.attn_implementation, device, needs_varlen)


def _load(cfg: AppConfig, cls, model_dir: Path, dtype: torch.dtype, **kwargs):
    """A HF model with the packed attention the trainer's forward passes use (and its
    blocks compiled when ``model.compile``)."""
    attention = attention_implementation(cfg, default_device())
    model = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention, **kwargs)
    if cfg.model.compile:
        log.info("torch.compile: %d blocks of %s", compile_blocks(model), type(model).__name__)
    return model


def _values_not_a_view(module, args, output):
    """The value head (``nn.Linear`` over ``[1, nnz, H]``) returns a view of its 2-D matmul,
    and the FSDP2 root returns it as is, which FSDP2 warns about (an in-place op on that
    view would skip its pre-backward hook). A copy of ``[1, nnz, 1]`` values costs nothing.
    Registered before sharding, so it runs before FSDP2's post-forward hook."""
    output.logits = output.logits.clone()
    return output


def _critic(cfg: AppConfig, model_dir: Path, compute: Precision):
    """A value head on the actor's backbone (freshly initialised from the global seed,
    identically on every rank), or on ``critic.model_path``'s: a reward model's backbone and
    score head start the critic (InstructGPT's); no dropout (the head defaults to 0.1). With
    ``critic.lora_rank``: adapters on the frozen backbone, the head trained in full."""
    path = Path(cfg.critic.model_path).expanduser() if cfg.critic.model_path else model_dir
    critic_config = AutoConfig.from_pretrained(path, num_labels=1)
    critic_config.classifier_dropout = 0.0
    if is_reward_model_dir(path):  # its head has no bias: load it exactly
        critic_config.token_classification_bias = False
    sharding = role_sharding(cfg.critic.fsdp, compute.dtype)
    lora = lora_of(cfg.critic)
    dtype = torch.float32 if lora is None else sharding.mixed_precision.param
    critic = _load(cfg, AutoModelForTokenClassification, path, dtype, config=critic_config)
    critic.register_forward_hook(_values_not_a_view)
    if lora is not None:
        head = next(n for n in ("score", "classifier") if hasattr(critic, n))
        critic = _with_adapters(critic, replace(lora, trained=(head,)), "critic")
    return shard_model(critic, sharding)


def _with_adapters(model, lora: Lora, role: str):
    """``model`` frozen, with ``lora``'s adapters (and its ``trained`` modules) in fp32."""
    model = lora.apply(model.requires_grad_(False))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "LoRA on the %s: rank %d, alpha %g on %s: %.2fM trained parameters of %.1fM, base in %s",
        role, lora.rank, lora.alpha, ",".join(lora.target_modules), trained / 1e6,
        sum(p.numel() for p in model.parameters()) / 1e6,
        next(p.dtype for p in model.parameters() if not p.requires_grad),
    )  # fmt: skip
    return model


def _actor(cfg: AppConfig, model_dir: Path, compute: Precision, lora: Lora | None):
    """The sharded policy -- fp32 master weights, or (LoRA) the frozen base in the role's
    parameter dtype with fp32 adapters -- and its update's FLOPs per token."""
    sharding = role_sharding(cfg.actor.fsdp, compute.dtype)
    if lora is None:
        model = _load(cfg, AutoModelForCausalLM, model_dir, torch.float32)
        return shard_model(model, sharding), _update_flops_per_token(model)
    base = _load(cfg, AutoModelForCausalLM, model_dir, sharding.mixed_precision.param)
    model = _with_adapters(base, lora, "actor")
    return shard_model(model, sharding), _update_flops_per_token(model)


def _update_flops_per_token(model) -> float:
    """The actor update's FLOPs per token: 6 per trained parameter (forward, input and
    weight gradients), 4 per frozen one (no weight gradient)."""
    return float(sum((6 if p.requires_grad else 4) * p.numel() for p in model.parameters()))


def _reference(cfg: AppConfig, model_dir: Path, compute: Precision, actor, lora: Lora | None):
    """The frozen reference, stored in the compute dtype (it has no master weights to keep);
    with LoRA the actor itself with its adapters off; ``None`` when neither KL path (in
    reward, in loss) reads it."""
    if not (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss):
        log.info("no reference model: algorithm.use_kl_in_reward and actor.use_kl_loss are off")
        return None
    if lora is not None:
        log.info("reference: the actor with its LoRA adapters off (no second copy)")
        return WithoutAdapters(actor)
    sharding = role_sharding(cfg.ref.fsdp, compute.dtype)
    ref = _load(cfg, AutoModelForCausalLM, model_dir, sharding.mixed_precision.param).eval()
    ref.requires_grad_(False)
    return shard_model(ref, sharding)


def _reward_model(cfg: AppConfig, compute: Precision, path: str = ""):
    """The frozen reward model (``reward_model.path``, or ``path``: an ensemble member),
    stored in the compute dtype like the reference; None without ``reward_model.enable``."""
    if not cfg.reward_model.enable:
        return None
    path = Path(path or cfg.reward_model.path).expanduser()
    sharding = role_sharding(cfg.reward_model.fsdp, compute.dtype)
    model = _load(
        cfg, AutoModelForTokenClassification, path, sharding.mixed_precision.param,
        config=scalar_head_config(path),
    ).eval()  # fmt: skip
    model.requires_grad_(False)
    return shard_model(model, sharding)


def build_components(
    cfg: AppConfig,
    model_dir: Path,
    tokenizer,
    rewards: RewardManager,
    rm_tokenizer=None,
    tools: Sequence[Tool] | None = None,
) -> Components:
    """Every component of the run around the checked tokenizers (the policy's, the reward
    model's), reward manager and tools (``rollout.multi_turn``); a collective (sharding,
    engine start)."""
    compute = resolve_precision(cfg.model.dtype, default_device())
    lora = lora_of(cfg.model)
    actor, flops = _actor(cfg, model_dir, compute, lora)
    ref = _reference(cfg, model_dir, compute, actor, lora)
    critic = _critic(cfg, model_dir, compute) if cfg.critic.enable else None
    reward_model = _reward_model(cfg, compute)
    ensemble = [_reward_model(cfg, compute, path) for path in cfg.reward_model.ensemble.paths]
    link = rollout_link()  # a generating rank of its own: the weights stream to it
    engine = (
        # a version is taken at the latest s + 1 updates after it was sent
        StreamedEngine(link.group, link.peer, keep=cfg.async_training.lag + 1)
        if link
        else build_engine(cfg, model_dir, tokenizer, compute)
    )
    # every training rank takes the gather; the first alone sends over the link
    fed = engine if link is None or link.group.rank() == 0 else None
    sync = _weight_sync(actor, fed, model_dir, compute, lora)
    return StepBuilder(cfg).components(
        actor=actor, engine=engine, weight_sync=sync,
        tokenizer=tokenizer, rewards=rewards, ref=ref, critic=critic, reward_model=reward_model,
        ensemble=ensemble,
        rm_tokenizer=rm_tokenizer, update_flops_per_token=flops,
        export_actor=_actor_export(actor, tokenizer, model_dir, lora), tools=tools,
    )  # fmt: skip


def _actor_export(actor, tokenizer, model_dir: Path, lora: Lora | None):
    """(run_dir, suffix="") → ``actor_hf<suffix>`` (streamed full weights), with LoRA the
    merged model and the peft adapter (``actor_lora<suffix>``)."""
    if lora is None:
        return lambda run_dir, suffix="": export_hf(actor, tokenizer, run_dir / f"actor_hf{suffix}")
    return lambda run_dir, suffix="": export_lora(
        actor, lora, model_dir, tokenizer, run_dir, suffix
    )


def _weight_sync(actor, engine, model_dir: Path, compute: Precision, lora: Lora | None):
    """Cast while streaming: the engine holds the compute dtype (half the bytes in bf16).
    With LoRA only the adapters are gathered and sent, merged into the engine's base."""
    if lora is None:
        return WeightSync(lambda: iter_full_state_dict(actor), engine, dtype=compute.dtype)
    adapters = lambda: iter_full_state_dict(actor, trainable_only=True)  # noqa: E731
    return AdapterSync(adapters, engine, model_dir, lora.scaling, dtype=compute.dtype)
