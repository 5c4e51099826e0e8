"""The config, read once into the step's objects: :class:`StepBuilder`.

:mod:`klppo_train.trainer.build` loads and shards the models; this module turns the config
around them into what the step and the probe take instead of the config — the trainees
(optimizer, loss built with its hyperparameters, update :class:`Pass`), the forward passes
that run in this configuration, the resolved algorithm choices, the :class:`StepPlan`, the
probe's :class:`ProbeShape` and the LR schedulers. After :meth:`StepBuilder.components`
nothing reads the config but the loop's own keys (steps, validation, checkpoints).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from klppo_train.agents.samplers import MultiTurn, Sampler, SingleTurn
from klppo_train.budgets.run_budgets import configured, longest_sequence
from klppo_train.checks.losses import effective_loss_mode, mode_hyperparameters
from klppo_train.checks.validate import sequence_parallel_size
from klppo_train.config.choices import TOKEN_BASELINE_ESTIMATORS
from klppo_train.config.roles import PASS_ROLES, run_roles, static_micro_batch_size
from klppo_train.config.schema import AppConfig
from klppo_train.data.rewards import RewardManager
from klppo_train.ppo.algorithm import KLInReward, make_advantage_fn, make_kl_controller
from klppo_train.ppo.components import Components
from klppo_train.ppo.dynamic_sampling import DynamicSampling, GroupFilter
from klppo_train.ppo.greedy_baseline import GreedyBaseline
from klppo_train.ppo.losses import PolicyLoss, ValueLoss
from klppo_train.ppo.rollout_correction import RolloutCorrection
from klppo_train.ppo.rollouts import ColocatedRollouts, RolloutSource, StepPlan
from klppo_train.ppo.rollouts_ahead import RolloutsAhead
from klppo_train.ppo.shaping import OverlongShaping
from klppo_train.ppo.step import rule_scores
from klppo_train.reward_model.hf_dir import same_tokenization, stored_normalization
from klppo_train.reward_model.serve import (
    Retemplate,
    RewardModelEnsemble,
    RewardModelPass,
    RewardModelReward,
)
from klppo_train.runtime.engine import RolloutStats, Sampling
from klppo_train.runtime.process_group import dp_size, sum_over_ranks
from klppo_train.runtime.sequence_parallel import sequence_parallel
from klppo_train.trainer.probe import QUADRATIC_ATTENTION, ProbeShape
from klppo_train.trainer.schedule import make_scheduler
from klppo_train.workers.passes import ForwardPass, Pass
from klppo_train.workers.trainee import Trainee
from ppo_core import SEQUENCE_MEAN_MODES
from rollout import RolloutEngine, Tool, WeightPublisher

log = logging.getLogger("klppo_train")


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the (sharded) trained parameters (a LoRA model's adapters only), fused: on
    SmolLM2-135M's fp32 masters on 2 CPU cores one step took 0.087 s fused, 0.37 s foreach,
    0.76 s with the default loop."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=True)


class StepBuilder:
    """Builds the step's objects from ``cfg`` (read here and nowhere below the step)."""

    def __init__(self, cfg: AppConfig) -> None:
        self.cfg = cfg
        self.sp = sequence_parallel(sequence_parallel_size(cfg))
        self.response_length = cfg.rollout.sampling.max_new_tokens  # T, the plan's one width

    def skips_old_log_prob_pass(self) -> bool:
        """verl's on-policy shortcut: with one mini-batch and one epoch the policy has not
        moved since it generated, so the update uses logπ_old = sg(logπ) and the
        old-log-prob pass is not run — unless the KL in the reward needs logπ before the
        update, or the estimator Σπ² (:meth:`sum_pi_squared`), or the samples come from older
        weights (``async_training`` with s > 0)."""
        cfg = self.cfg
        one_update = (
            cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
        )
        return (
            one_update
            and not cfg.algorithm.use_kl_in_reward
            and not self._decoupled()
            and not self.sum_pi_squared()
            and not cfg.async_training.lag  # samples of older weights: π_old recomputed
        )

    def sum_pi_squared(self) -> bool:
        """Whether the old-log-prob pass computes Σπ² (the optimal token baseline reads it)."""
        cfg = self.cfg
        return (
            cfg.actor.calculate_sum_pi_squared
            or cfg.algorithm.adv_estimator in TOKEN_BASELINE_ESTIMATORS
        )

    def _decoupled(self) -> bool:
        """Rollout correction that weighs π_old against π_rollout before the update."""
        rc = self.cfg.algorithm.rollout_correction
        return rc.enabled and not rc.bypass_mode

    def sampled_prompts(
        self,
        c: Components,
        more: Callable[[], Sequence],
        last_step: int | None = None,
        dataset: Sequence = (),
    ) -> RolloutSource:
        """The step's rollout source: ``c.rollouts``; with ``algorithm.filter_groups`` DAPO's
        dynamic sampling over it, taking further prompts from ``more()``; with
        ``adv_estimator=remax`` one that adds ReMax's greedy baselines; with
        ``async_training`` either of them generated s steps ahead (until ``last_step``; the
        batches in flight are checkpointed by their prompts' rows of ``dataset``)."""
        source = self.sampled(c, more)
        at = self.cfg.async_training
        if not at.enable:
            return source
        log.info(
            "async_training: each batch generated %d step(s) ahead of its update; rollout "
            "correction's weights: %s", at.lag,
            self.cfg.algorithm.rollout_correction.rollout_is or "none",
        )  # fmt: skip
        return RolloutsAhead(source, at.lag, more, c.engine, last_step, dataset)

    def sampled(self, c: Components, more: Callable[[], Sequence]) -> RolloutSource:
        """``c.rollouts``, or dynamic sampling / ReMax's baselines over it (``c``: what has
        ``rollouts``, ``tokenizer``, ``rewards`` and ``shaping``)."""
        fg = self.cfg.algorithm.filter_groups
        score = functools.partial(rule_scores, c.tokenizer, c.rewards)
        if self.cfg.algorithm.adv_estimator == "remax":
            return GreedyBaseline(c.rollouts, score, c.shaping)
        if not fg.enable:
            return c.rollouts
        groups = GroupFilter(fg.metric, fg.max_num_gen_batches, c.shaping)
        log.info(
            "dynamic sampling: groups whose %s does not vary are dropped (generation batches "
            "a step: at most %s)", fg.metric, fg.max_num_gen_batches or "no limit",
        )  # fmt: skip
        return DynamicSampling(c.rollouts, groups, more, score, self.cfg.data.train_batch_size)

    def rollout_correction(self) -> RolloutCorrection | None:
        return RolloutCorrection.of(self.cfg.algorithm.rollout_correction)

    def forward_pass(self, name: str, model: nn.Module, **computes) -> ForwardPass:
        """Pass ``name`` of ``model`` over the step's responses, micro-batched as its role
        says."""
        cfg = self.cfg
        return ForwardPass(
            name=name,
            micro_batch_size=static_micro_batch_size(cfg, PASS_ROLES[name]),
            model=model,
            response_length=self.response_length,
            share_prompts=cfg.model.share_prompts,
            temperature=cfg.rollout.sampling.temperature,
            sp=self.sp,
            **computes,
        )

    def policy_loss(self) -> PolicyLoss:
        a, correction = self.cfg.actor, self.rollout_correction()
        mode = effective_loss_mode(a, self.cfg.algorithm.rollout_correction)
        bypass = correction if correction is not None and correction.bypass else None
        hyper = mode_hyperparameters(a, "vanilla" if bypass else mode)
        agg = "seq-mean-token-mean" if mode in SEQUENCE_MEAN_MODES else a.loss_agg_mode
        if mode != "vanilla":
            log.info("policy loss: %s %s, aggregated %s", mode, hyper, agg)
        return PolicyLoss(
            loss_mode="vanilla" if bypass else mode,
            hyperparameters=tuple(hyper.items()),
            policy_agg_mode=agg,
            loss_agg_mode=a.loss_agg_mode,
            entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type,
            temperature=self.cfg.rollout.sampling.temperature,
            share_prompts=self.cfg.model.share_prompts,
            sp=self.sp,
            bypass=bypass,
        )

    def value_loss(self) -> ValueLoss:
        return ValueLoss(
            cliprange_value=self.cfg.critic.cliprange_value,
            loss_agg_mode=self.cfg.critic.loss_agg_mode,
            share_prompts=self.cfg.model.share_prompts,
            sp=self.sp,
        )

    def trainee(self, name: str, model: nn.Module, loss) -> Trainee:
        """The actor or the critic (``name``: its config section) with its optimizer and
        update pass."""
        cfg, section = self.cfg, getattr(self.cfg, name)
        prompts = section.ppo_mini_batch_size  # over all ranks (global mini-batches)
        mine = min(prompts, cfg.data.train_batch_size // dp_size())
        return Trainee(
            name=name,
            model=model,
            optimizer=adamw(model, section.lr, section.weight_decay),
            loss=loss,
            update=Pass(name=f"update_{name}", micro_batch_size=static_micro_batch_size(cfg, name)),
            epochs=section.ppo_epochs,
            rows_per_mini_batch=mine * cfg.rollout.sampling.n,
            prompts_per_mini_batch=prompts,
            grad_clip=section.grad_clip,
            offload_optimizer=section.fsdp.optimizer_offload,
            share_prompts=cfg.model.share_prompts,
            saves_frozen=not (cfg.model if name == "actor" else section).lora_rank,
        )

    def stop_ids(self, tokenizer) -> frozenset[int]:
        """The ids that end a response: EOS and ``rollout.sampling.stop_token_ids``."""
        return frozenset({tokenizer.eos_token_id, *self.cfg.rollout.sampling.stop_token_ids})

    def retemplate(self, tokenizer, rm_tokenizer) -> Retemplate | None:
        """How the reward model reads the responses (``reward_model.retemplate``): None =
        the policy's token ids as they are."""
        mode = self.cfg.reward_model.retemplate
        if mode == "never" or (mode == "auto" and same_tokenization(tokenizer, rm_tokenizer)):
            return None
        log.info("reward model: re-templating the conversations with its own tokenizer")
        return Retemplate(
            tokenizer,
            rm_tokenizer,
            max_prompt_length=self.cfg.data.max_prompt_length,
            response_length=self.response_length,
            stop_ids=self.stop_ids(tokenizer),
        )

    def reward_model(
        self, model: nn.Module, tokenizer, rm_tokenizer, ensemble: Sequence[nn.Module] = ()
    ) -> RewardModelReward:
        """The reward model's scoring pass (an ensemble's, with ``ensemble``: the other
        members' models) and the reward built on it (``reward_model.*``)."""
        rm = self.cfg.reward_model
        retemplate = self.retemplate(tokenizer, rm_tokenizer)
        passes = [self._scoring_pass(m, retemplate) for m in (model, *ensemble)]
        scoring = passes[0]
        if ensemble:
            paths = (rm.path, *rm.ensemble.paths)
            standardize = tuple(stored_normalization(Path(p).expanduser()) for p in paths)
            scoring = RewardModelEnsemble(tuple(passes), standardize)
            log.info(
                "reward model: an ensemble of %d, reduced by %s", len(paths), rm.ensemble.reduce
            )
        # an ensemble's members are standardized already: "stored" has nothing left to apply
        stored = rm.normalize == "stored" and not ensemble
        mean, std = stored_normalization(rm.path) if stored else (0.0, 1.0)
        return RewardModelReward(
            scoring,
            normalize=rm.normalize,
            normalize_samples=rm.normalize_samples,
            clip_range=rm.clip_range,
            missing_eos_penalty=rm.missing_eos_penalty,
            stop_ids=self.stop_ids(tokenizer),
            combine=rm.combine,
            rule_weight=rm.rule_weight,
            mean=mean,
            std=std,
            reduce=rm.ensemble.reduce,
        )

    def _scoring_pass(self, model: nn.Module, retemplate: Retemplate | None) -> RewardModelPass:
        return RewardModelPass(
            name="reward_model",
            micro_batch_size=static_micro_batch_size(self.cfg, "reward_model"),
            model=model,
            response_length=self.response_length,
            share_prompts=False,
            retemplate=retemplate,
        )

    def components(
        self,
        *,
        actor: nn.Module,
        engine: RolloutEngine,
        weight_sync: WeightPublisher,
        tokenizer,
        rewards: RewardManager,
        ref: nn.Module | None = None,
        critic: nn.Module | None = None,
        reward_model: nn.Module | None = None,
        ensemble: Sequence[nn.Module] = (),
        rm_tokenizer=None,
        update_flops_per_token: float = 0.0,
        export_actor: Callable[..., Any] | None = None,
        tools: Sequence[Tool] | None = None,
    ) -> Components:
        """The step's objects around the run's models (sharded or not): trainees with their
        optimizers and losses, the forward passes that run in this configuration, the
        resolved algorithm choices and the :class:`StepPlan`."""
        cfg = self.cfg
        kl_controller = make_kl_controller(cfg.algorithm)
        has_critic = critic is not None
        plan = self.plan()
        sampler = self.sampler(engine, tokenizer, tools)
        rollouts = ColocatedRollouts(
            engine, weight_sync, plan, tokenizer.pad_token_id, sampler, self.rollout_stats(engine)
        )
        return Components(
            actor=self.trainee("actor", actor, self.policy_loss()),
            engine=engine,
            sampler=sampler,
            weight_sync=weight_sync,
            rollouts=rollouts,
            tokenizer=tokenizer,
            rewards=rewards,
            kl_controller=kl_controller,
            advantage_fn=make_advantage_fn(
                cfg.algorithm, dp_sum=sum_over_ranks if dp_size() > 1 else None
            ),
            plan=plan,
            kl_in_reward=(
                KLInReward(cfg.algorithm.kl_penalty, kl_controller)
                if cfg.algorithm.use_kl_in_reward
                else None
            ),
            old_log_prob=self._old_log_prob_pass(actor),
            on_policy_shortcut=self.skips_old_log_prob_pass(),
            ref=self.forward_pass("ref", ref) if ref is not None else None,
            values=self.forward_pass("values", critic, values=True) if has_critic else None,
            critic=self.trainee("critic", critic, self.value_loss()) if has_critic else None,
            reward_model=(
                self.reward_model(reward_model, tokenizer, rm_tokenizer, ensemble)
                if reward_model is not None
                else None
            ),
            update_flops_per_token=update_flops_per_token,
            export_actor=export_actor,
            rollout_correction=self.rollout_correction(),
            shaping=self.shaping(),
        )

    def sampler(self, engine: RolloutEngine, tokenizer, tools: Sequence[Tool] | None) -> Sampler:
        """The engine's single turn, or with ``rollout.multi_turn.enable`` conversations with
        the checked ``tools`` over it."""
        mt = self.cfg.rollout.multi_turn
        if not mt.enable:
            return SingleTurn(engine)
        log.info(
            "multi-turn rollouts: tools %s, up to %s assistant turns, %s format; the loss "
            "skips the tools' tokens", [t.name for t in tools or ()],
            mt.max_assistant_turns or "unlimited", mt.format,
        )  # fmt: skip
        return MultiTurn.build(engine, tokenizer, list(tools or ()), mt)

    def shaping(self) -> OverlongShaping | None:
        """DAPO's overlong penalty on the sequence rewards (``reward_model.overlong_buffer``)."""
        buf = self.cfg.reward_model.overlong_buffer
        if not buf.enable:
            return None
        log.info("overlong penalty: the last %d of %d tokens, up to %s", buf.len,
                 self.response_length, buf.penalty_factor)  # fmt: skip
        return OverlongShaping(self.response_length, buf.len, buf.penalty_factor, buf.log)

    def plan(self) -> StepPlan:
        cfg = self.cfg
        return StepPlan(
            sampling=self.sampling(),
            response_length=self.response_length,
            balance_batch=cfg.trainer.balance_batch,
            sp=self.sp,
        )

    def _old_log_prob_pass(self, actor: nn.Module) -> ForwardPass | None:
        """The old-log-prob pass; None in bypass mode. Built on the on-policy shortcut too:
        a step runs it for samples of an older policy version."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            log.info("rollout correction's bypass mode: logπ_old = the engine's, no old pass")
            return None
        if self.skips_old_log_prob_pass():
            log.info(
                "on-policy steps (one mini-batch, actor.ppo_epochs=1, no KL in reward): "
                "logπ_old = sg(logπ) in the update, no old-log-prob pass for samples of the "
                "weights being trained"
            )
        spp = self.sum_pi_squared()
        return self.forward_pass("old_log_prob", actor, with_entropy=True, with_sum_pi_squared=spp)

    def rollout_stats(self, engine) -> RolloutStats | None:
        """vLLM's counters as step metrics, when it keeps them (``rollout.disable_log_stats``
        false; off by default, as in verl)."""
        r = self.cfg.rollout
        return RolloutStats(engine) if r.engine == "vllm" and not r.vllm.disable_log_stats else None

    def sampling(self) -> Sampling:
        r = self.cfg.rollout
        return Sampling(r.sampling, self.cfg.trainer.seed, r.val_temperature)

    def configured_budgets(self) -> dict[str, int | str]:
        """Each role's budget as the config gives it: a number or ``auto``."""
        return {role: configured(self.cfg, role) for role in run_roles(self.cfg)}

    def probe_shape(self) -> ProbeShape:
        """What the probe of ``auto`` budgets needs of the config."""
        cfg = self.cfg
        return ProbeShape(
            sequence=longest_sequence(cfg),
            response=self.response_length,
            step_rows=cfg.data.train_batch_size * cfg.rollout.sampling.n // dp_size(),
            quadratic=cfg.model.attn_implementation in QUADRATIC_ATTENTION,
            memory_limit_gib=cfg.trainer.memory_limit_gib,
            # vLLM's level-2 sleep drops the weights (only a weight sync brings them back)
            engine_sleeps=cfg.rollout.engine != "vllm" or cfg.rollout.vllm.sleep_level == 1,
        )

    def schedulers(self, c: Components, total_steps: int) -> list:
        """Actor: warm-up then constant/cosine; critic: warm-up then constant."""
        actor, critic = self.cfg.actor, self.cfg.critic
        schedulers = [
            make_scheduler(
                c.actor.optimizer,
                warmup_steps=actor.lr_warmup_steps,
                total_steps=total_steps,
                kind=actor.lr_scheduler,
            )
        ]
        if c.critic is not None:
            schedulers.append(
                make_scheduler(
                    c.critic.optimizer,
                    total_steps=total_steps,
                    warmup_steps=critic.lr_warmup_steps,
                    kind="constant",
                )
            )
        return schedulers
