"""One PPO step, in numbered stages, over components built elsewhere and passed in.

generate (+ balance over ranks) → engine sleeps → old log-probs → ref log-probs → values →
scores → KL in reward → advantages → critic update → actor update → engine wakes → weight
sync → metrics. Every stage is timed (``timing_s/<stage>``). Each forward pass and update
runs within its role's token budget (``c.budgets``) and, on out-of-memory, halves it and
redoes the pass (:mod:`klppo_train.budgets`). Under torchrun every rank runs
every stage on its own share of the prompts (with all ``n`` samples of a prompt on one rank,
so GRPO/RLOO groups stay whole); agreed micro-batch counts, the losses' global token counts,
whitening over all ranks, FSDP's gradient reduction and the KL controller's all-reduce make
the step equal to one process on the whole batch. The returned metrics are this rank's; the
run logs them combined (``distributed.global_metrics``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_sharding import default_device
from klppo_train.actor import PolicyBatch, actor_update_step
from klppo_train.algorithm import advantage_metrics, explained_variance, kl_in_reward
from klppo_train.balance import balance_rollouts
from klppo_train.batch import RolloutTensors, rollout_tensors
from klppo_train.budgets import PASS_ROLE, run_with_backoff, uses_budget
from klppo_train.components import Components, timed
from klppo_train.config import AppConfig
from klppo_train.critic import ValueBatch, critic_update_step
from klppo_train.data import PromptItem
from klppo_train.distributed import rank_span, world_size
from klppo_train.engine import request_seeds, sampling_config
from klppo_train.forward import response_logprobs, response_values
from klppo_train.rewards import RewardManager
from klppo_train.update import select_rows, static_micro_batch_size
from ppo_core import masked_mean
from rollout import logprob_mismatch


def score_responses(c: Components, items: Sequence[PromptItem], t: RolloutTensors) -> torch.Tensor:
    """Sequence scores on the last response token (``[N, T]``)."""
    scores = []
    for row, index in enumerate(t.prompt_index.tolist()):
        ids = t.response_ids[row][t.response_mask[row].bool()].tolist()
        text = c.tokenizer.decode(ids, skip_special_tokens=True)
        item = items[index]
        scores.append(c.rewards.score(item.data_source, text, item.ground_truth, item.extra_info))
    return RewardManager.token_scores(t.response_ids, t.response_mask, scores)


def _mini_batches(prompts: torch.Tensor, rows_per_mini: int, seed: int) -> list[torch.Tensor]:
    """Row indices of mini-batches in a shuffled order of whole prompts: a prompt's ``n``
    samples stay in one mini-batch (as in verl, whose mini-batches count prompts) whenever
    ``rows_per_mini`` is a multiple of ``n``, so GRPO-style groups and shared prompt tokens
    (``model.share_prompts``) stay together."""
    _, prompt = torch.unique(prompts.cpu(), return_inverse=True)
    shuffled = torch.randperm(int(prompt.max()) + 1, generator=torch.Generator().manual_seed(seed))
    place = torch.empty_like(shuffled)
    place[shuffled] = torch.arange(len(shuffled))
    order = torch.argsort(place[prompt], stable=True)
    return [order[i : i + rows_per_mini] for i in range(0, len(order), rows_per_mini)]


def _epochs(update, batch, prompts, epochs: int, rows_per_mini: int, seed: int) -> dict:
    """Run ``update`` over shuffled mini-batches of whole prompts (``prompts``: each row's
    prompt index) for ``epochs``; average the metrics."""
    sums: dict[str, float] = {}
    steps = 0
    for epoch in range(epochs):
        for rows in _mini_batches(prompts, rows_per_mini, seed + epoch):
            for name, value in update(select_rows(batch, rows)).items():
                sums[name] = sums.get(name, 0.0) + value
            steps += 1
    return {name: value / steps for name, value in sums.items()}


def skips_old_log_prob_pass(cfg: AppConfig) -> bool:
    """verl's on-policy shortcut: with one mini-batch and one epoch the policy has not moved
    since it generated, so the update uses logπ_old = sg(logπ) and the old-log-prob pass is
    not run — unless the KL in the reward needs logπ before the update."""
    one_update = (
        cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    )
    return one_update and not cfg.algorithm.use_kl_in_reward


@torch.no_grad()
def no_grad_logprobs(model, t: RolloutTensors, cfg: AppConfig, role, budget: int, **kwargs):
    """Response log-probs (and entropy with ``with_entropy=True``) of ``model`` on the batch,
    micro-batched within ``budget`` tokens or as ``role`` (``cfg.rollout``/``cfg.ref``)
    fixes it."""
    return response_logprobs(
        model,
        t.input_ids,
        t.attention_mask,
        cfg.rollout.sampling.max_new_tokens,
        temperature=cfg.rollout.sampling.temperature,
        max_tokens=budget,
        micro_batch_size=static_micro_batch_size(
            role.log_prob_use_dynamic_bsz, role.log_prob_micro_batch_size_per_gpu
        ),
        share_prompts=cfg.model.share_prompts,
        **kwargs,
    )


def no_grad_values(model, t: RolloutTensors, cfg: AppConfig, budget: int) -> torch.Tensor:
    with torch.no_grad():
        return response_values(
            model,
            t.input_ids,
            t.attention_mask,
            cfg.rollout.sampling.max_new_tokens,
            max_tokens=budget,
            micro_batch_size=static_micro_batch_size(
                cfg.critic.use_dynamic_bsz, cfg.critic.ppo_micro_batch_size_per_gpu
            ),
            share_prompts=cfg.model.share_prompts,
        )


def _pass(c: Components, cfg: AppConfig, name: str, step: int, run, reset=None):
    """Run pass ``name`` within its role's budget, backing off on out-of-memory."""
    dynamic = uses_budget(cfg, PASS_ROLE[name])
    return run_with_backoff(c.budgets, name, step, run, dynamic=dynamic, reset=reset)


@dataclass(frozen=True)
class ForwardPasses:
    """The step's forward-only outputs, ``[N, T]`` each (None where that pass did not run)."""

    old: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    values: torch.Tensor | None = None


def _generate(c: Components, items: Sequence[PromptItem], cfg: AppConfig, step: int, span):
    """``(items, tensors, balance metrics)``: this rank's rollouts, re-split over the ranks by
    tokens when ``trainer.balance_batch``."""
    batch = c.engine.generate(
        [list(i.prompt_ids) for i in items],
        sampling_config(cfg, step=step),
        seeds=request_seeds(cfg, step, span),
    )
    balance: dict[str, float] = {}
    if cfg.trainer.balance_batch:
        items, batch, balance = balance_rollouts(items, batch)
    tensors = rollout_tensors(
        [i.prompt_ids for i in items],
        batch,
        pad_token_id=c.tokenizer.pad_token_id,
        response_length=cfg.rollout.sampling.max_new_tokens,
        device=default_device(),
    )
    return items, tensors, balance


def _forward_passes(c: Components, t: RolloutTensors, cfg: AppConfig, step: int) -> ForwardPasses:
    old = entropy = ref = values = None
    if not skips_old_log_prob_pass(cfg):
        with timed(c, "old_log_prob"):
            old, entropy = _pass(
                c, cfg, "old_log_prob", step,
                lambda budget: no_grad_logprobs(
                    c.actor, t, cfg, cfg.rollout, budget, with_entropy=True
                ),
            )  # fmt: skip
    if c.ref is not None:
        with timed(c, "ref"):
            ref, _ = _pass(
                c, cfg, "ref", step, lambda budget: no_grad_logprobs(c.ref, t, cfg, cfg.ref, budget)
            )  # fmt: skip
    if c.critic is not None:
        with timed(c, "values"):
            values = _pass(
                c, cfg, "values", step, lambda budget: no_grad_values(c.critic, t, cfg, budget)
            )  # fmt: skip
    return ForwardPasses(old, entropy, ref, values)


def _advantages(c: Components, items, t: RolloutTensors, cfg: AppConfig, p: ForwardPasses):
    """``(scores, advantages, returns, kl metrics)``: rewards, the KL in the reward, the
    resolved estimator."""
    scores = score_responses(c, items, t)
    rewards, metrics = scores, {}
    if cfg.algorithm.use_kl_in_reward and p.ref is not None:
        rewards, metrics = kl_in_reward(
            scores, p.old, p.ref, t.response_mask, cfg.algorithm, c.kl_controller
        )
    advantages, returns = c.advantage_fn(
        rewards, t.response_mask, values=p.values, group_ids=t.prompt_index
    )
    return scores, advantages, returns, metrics


def _update_critic(c: Components, t: RolloutTensors, p, returns, cfg: AppConfig, step: int):
    batch = ValueBatch(t.input_ids, t.attention_mask, t.response_mask, p.values, returns)

    def update(mb: ValueBatch) -> dict[str, float]:
        return _pass(
            c, cfg, "update_critic", step,
            lambda budget: critic_update_step(
                c.critic, c.critic_optimizer, mb, cfg.critic, max_tokens=budget,
                share_prompts=cfg.model.share_prompts,
            ),
            reset=lambda: c.critic_optimizer.zero_grad(set_to_none=True),
        )  # fmt: skip

    return _epochs(
        update,
        batch,
        t.prompt_index,
        cfg.critic.ppo_epochs,
        cfg.critic.ppo_mini_batch_size * cfg.rollout.sampling.n // world_size(),
        step,
    )


def _update_actor(c: Components, t: RolloutTensors, p, advantages, cfg: AppConfig, step: int):
    batch = PolicyBatch(
        t.input_ids,
        t.attention_mask,
        t.response_mask,
        p.old,
        advantages,
        p.ref,
        engine_logprobs=t.engine_logprobs if p.old is None else None,
    )

    def update(mb: PolicyBatch) -> dict[str, float]:
        return _pass(
            c, cfg, "update_actor", step,
            lambda budget: actor_update_step(
                c.actor, c.actor_optimizer, mb, cfg.actor, max_tokens=budget,
                temperature=cfg.rollout.sampling.temperature,
                share_prompts=cfg.model.share_prompts,
            ),
            reset=lambda: c.actor_optimizer.zero_grad(set_to_none=True),
        )  # fmt: skip

    return _epochs(
        update,
        batch,
        t.prompt_index,
        cfg.actor.ppo_epochs,
        cfg.actor.ppo_mini_batch_size * cfg.rollout.sampling.n // world_size(),
        step,
    )


def _step_metrics(t: RolloutTensors, p: ForwardPasses, scores, advantages, returns) -> dict:
    mask = t.response_mask
    metrics = advantage_metrics(advantages, returns, mask)
    if p.values is not None:
        metrics["critic/vf_explained_var"] = explained_variance(p.values, returns, mask)
    if p.old is not None:  # else the update measured both in its own forward
        mismatch = logprob_mismatch(t.engine_logprobs, p.old, mask)
        metrics.update({k: float(v) for k, v in mismatch.items()})
        metrics["actor/entropy"] = float(masked_mean(p.entropy, mask))
    metrics.update(
        {
            "critic/score/mean": float((scores * mask).sum(-1).mean()),
            "response_length/mean": float(mask.sum(-1).float().mean()),
            "perf/response_tokens": float(mask.sum()),
            "actor/policy_version_sampled": float(t.policy_version),
            "actor/entropy_rollout": float(masked_mean(-t.engine_logprobs, mask)),
            "actor/on_policy_shortcut": float(p.old is None),
        }
    )
    return metrics


def ppo_step(
    c: Components, items: Sequence[PromptItem], cfg: AppConfig, *, step: int, version: int
) -> dict[str, float]:
    """Train on one batch of prompts (this rank's slice of it); the engine ends up holding
    weights ``version``."""
    c.timings.clear()
    step_start = time.perf_counter()
    if default_device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    span = rank_span(len(items))
    items = items[span.start : span.stop]
    with timed(c, "gen"):
        items, t, balance = _generate(c, items, cfg, step, span)
    # Free the engine's GPU memory for the passes (verl's free_cache_engine).
    with timed(c, "sleep"):
        c.engine.sleep()
    retries_before = c.budgets.oom_retries
    passes = _forward_passes(c, t, cfg, step)
    with timed(c, "adv"):
        scores, advantages, returns, metrics = _advantages(c, items, t, cfg, passes)
    if c.critic is not None:
        with timed(c, "update_critic"):
            metrics.update(_update_critic(c, t, passes, returns, cfg, step))
    with timed(c, "update_actor"):
        metrics.update(_update_actor(c, t, passes, advantages, cfg, step))
    with timed(c, "wake_up"):
        c.engine.wake_up()
    with timed(c, "update_weights"):
        c.weight_sync.sync(version=version)
    metrics.update(_step_metrics(t, passes, scores, advantages, returns))
    metrics.update(c.rewards.metrics(reset=True))
    metrics.update(balance)
    metrics.update(c.budgets.metrics())
    metrics["perf/oom_retries"] = float(c.budgets.oom_retries - retries_before)
    c.timings["timing_s/step"] = time.perf_counter() - step_start
    metrics.update(c.timings)
    metrics.update(_perf_metrics(c, t, cfg))
    return metrics


def _perf_metrics(c: Components, t: RolloutTensors, cfg: AppConfig) -> dict[str, float]:
    """verl's ``perf/throughput`` (prompt + response tokens per second per device), the actor
    update's achieved TFLOP/s (6 · params · tokens · epochs, attention not counted, every
    sample's prompt counted: with ``model.share_prompts`` fewer tokens ran; divide by the
    device's peak for MFU) and peak memory (CUDA: allocated/reserved this step; CPU: the
    process's peak RSS so far)."""
    tokens = float(t.attention_mask.sum())
    out = {"perf/throughput": tokens / c.timings["timing_s/step"]}
    update = c.timings.get("timing_s/update_actor")
    if update and c.actor_params:
        flops = 6 * c.actor_params * tokens * cfg.actor.ppo_epochs
        out["perf/actor_update_tflops"] = flops / update / 1e12
    if default_device().type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        out["perf/max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out
