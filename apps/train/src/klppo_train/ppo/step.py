"""One PPO step, in numbered stages, over components built once and passed in.

1 generate (+ balance over ranks) → 2 engine sleeps → 3 old log-probs → 4 ref log-probs →
5 values → 5a rollout correction → 5b reward-model scores → 6 scores, KL in reward,
advantages → 7 critic update → 8 actor update → 9 engine wakes → 10 weight sync → 11 metrics.

Every stage is timed (``timing_s/<stage>``). Each forward pass and update runs within its
role's token budget (``c.budgets``) and, on out-of-memory, halves it and redoes the pass
(:mod:`klppo_train.budgets.run_budgets`). Under torchrun every rank runs every stage on its
own share of the prompts (with all ``n`` samples of a prompt on one rank, so GRPO/RLOO
groups stay whole); agreed micro-batch counts, the losses' global token counts, whitening over all
ranks, FSDP's gradient reduction and the KL controller's all-reduce make the step equal to
one process on the whole batch. The returned metrics are this rank's; the run logs them
combined (``distributed.global_metrics``). Nothing here reads the config: the passes,
trainees and the :class:`StepPlan` in :class:`Components` were built from it once.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from fsdp_sharding import default_device
from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.algorithm import advantage_metrics, explained_variance
from klppo_train.ppo.components import Components
from klppo_train.ppo.trajectories import Trajectories, trajectories
from klppo_train.runtime.balance import balance_rollouts
from klppo_train.runtime.process_group import concat_over_ranks, rank_span
from klppo_train.runtime.sequence_parallel import shared
from ppo_core import masked_mean, token_level_scores
from rollout import logprob_mismatch


class Timings(dict):
    """``timing_s/<stage>`` of one step."""

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self[f"timing_s/{stage}"] = time.perf_counter() - start


def rule_scores(c: Components, items: Sequence[PromptItem], t: Trajectories) -> torch.Tensor:
    """The rule reward of each response ``[N]``."""
    scores = []
    for row, index in enumerate(t.prompt_index.tolist()):
        ids = t.response_ids[row][t.response_mask[row].bool()].tolist()
        text = c.tokenizer.decode(ids, skip_special_tokens=True)
        item = items[index]
        scores.append(c.rewards.score(item.data_source, text, item.ground_truth, item.extra_info))
    return torch.tensor(scores, dtype=torch.float32, device=t.response_mask.device)


def score_responses(
    c: Components, items: Sequence[PromptItem], t: Trajectories, rm_raw: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence rewards on the last response token (``[N, T]``): the rule's, or the reward
    model's (``rm_raw``: its raw scores) as ``reward_model.combine`` says; its metrics."""
    if c.reward_model is None:
        return token_level_scores(rule_scores(c, items, t), t.response_mask), {}
    rule = rule_scores(c, items, t) if c.reward_model.uses_rule else None
    rewards, metrics = c.reward_model.reward(rm_raw, rule, t)
    return token_level_scores(rewards, t.response_mask), metrics


def _generate(c: Components, items: Sequence[PromptItem], step: int, span: range):
    """``(items, trajectories, balance metrics)``: this rank's rollouts, re-split over the
    ranks by tokens when ``trainer.balance_batch``."""
    plan = c.plan
    batch = c.engine.generate(
        [list(i.prompt_ids) for i in items],
        plan.sampling.for_step(step),
        seeds=plan.sampling.request_seeds(step, span),
    )
    batch = shared(batch, plan.sp)
    balance: dict[str, float] = {}
    positions = list(span)
    if plan.balance_batch:
        items, batch, balance, positions = balance_rollouts(items, batch)
    t = trajectories(
        [i.prompt_ids for i in items],
        batch,
        pad_token_id=c.tokenizer.pad_token_id,
        response_length=plan.response_length,
        device=default_device(),
        positions=positions,
    )
    return items, t, balance


def _forward_passes(c: Components, t: Trajectories, step: int, timed: Timings) -> Trajectories:
    """Stages 3–5: the forward-only passes that run in this configuration (the reward
    model's, 5b, is :func:`_reward_model_scores`)."""
    if c.old_log_prob is not None:
        with timed("old_log_prob"):
            old, entropy = c.old_log_prob(t, c.budgets, step)
        t = replace(t, old_logprobs=old, entropy=entropy)
    if c.ref is not None:
        with timed("ref"):
            t = replace(t, ref_logprobs=c.ref(t, c.budgets, step)[0])
    if c.values is not None:
        with timed("values"):
            t = replace(t, values=c.values(t, c.budgets, step))
    return t


def _rollout_correction(c: Components, t: Trajectories):
    """Stage 5a: ``(trajectories, the response mask of the updates or None, metrics)``.
    Bypass mode takes π_old = π_rollout; decoupled, the importance weights of π_old vs
    π_rollout go into the trajectories, and the mask without the rejected tokens is the
    updates' (rewards and advantages see whole responses)."""
    rc = c.rollout_correction
    if rc is None:
        return t, None, {}
    if rc.bypass:
        return replace(t, old_logprobs=t.engine_logprobs), None, {}
    return rc.decoupled(t)


def _reward_model_scores(c: Components, items, t: Trajectories, step: int, timed: Timings):
    """Stage 5b: the reward model's raw scores ``[N]`` (None without one)."""
    if c.reward_model is None:
        return None
    with timed("reward_model"):
        return c.reward_model.scoring(t, c.budgets, step, items)


def _advantages(
    c: Components, items, t: Trajectories, rm_raw: torch.Tensor | None
) -> tuple[Trajectories, torch.Tensor, dict]:
    """Stage 6: ``(trajectories with advantages and returns, scores, kl and reward-model
    metrics)``."""
    scores, metrics = score_responses(c, items, t, rm_raw)
    rewards = scores
    if c.kl_in_reward is not None:
        rewards, kl = c.kl_in_reward(scores, t.old_logprobs, t.ref_logprobs, t.response_mask)
        metrics.update(kl)
    advantages, returns = c.advantage_fn(
        rewards, t.response_mask, values=t.values, group_ids=t.prompt_index
    )
    return replace(t, advantages=advantages, returns=returns), scores, metrics


def _step_metrics(t: Trajectories, scores: torch.Tensor) -> dict[str, float]:
    mask = t.response_mask
    metrics = advantage_metrics(t.advantages, t.returns, mask)
    if t.values is not None:
        metrics["critic/vf_explained_var"] = explained_variance(t.values, t.returns, mask)
    if t.entropy is not None:  # the old-log-prob pass ran; else the update measured both
        mismatch = logprob_mismatch(t.engine_logprobs, t.old_logprobs, mask)
        metrics.update({k: float(v) for k, v in mismatch.items()})
        metrics["actor/entropy"] = float(masked_mean(t.entropy, mask))
    metrics.update(
        {
            "critic/score/mean": float((scores * mask).sum(-1).mean()),
            "response_length/mean": float(mask.sum(-1).float().mean()),
            "perf/response_tokens": float(mask.sum()),
            "actor/policy_version_sampled": float(t.policy_version),
            "actor/entropy_rollout": float(masked_mean(-t.engine_logprobs, mask)),
            "actor/on_policy_shortcut": float(t.old_logprobs is None),
        }
    )
    return metrics


def ppo_step(c: Components, items: Sequence[PromptItem], step: int) -> dict[str, float]:
    """Train on one batch of prompts (this rank's slice of it); the engine ends up holding
    the weights of version ``step``."""
    timed = Timings()
    step_start = time.perf_counter()
    if default_device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    span = rank_span(len(items))
    items = items[span.start : span.stop]
    with timed("gen"):  # 1
        counted = c.rollout_stats.counts() if c.rollout_stats else {}
        items, t, balance = _generate(c, items, step, span)
        rollout = c.rollout_stats.since(counted) if c.rollout_stats else {}
    with timed(
        "sleep"
    ):  # 2: free the engine's GPU memory for the passes (verl's free_cache_engine)
        c.engine.sleep()
    retries_before = c.budgets.oom_retries
    t = _forward_passes(c, t, step, timed)  # 3, 4, 5
    t, kept, corrected = _rollout_correction(c, t)  # 5a
    rm_raw = _reward_model_scores(c, items, t, step, timed)  # 5b
    with timed("adv"):  # 6
        t, scores, metrics = _advantages(c, items, t, rm_raw)
    metrics.update(corrected)
    updated = t if kept is None else replace(t, response_mask=kept)
    if c.critic is not None:
        with timed("update_critic"):  # 7
            metrics.update(c.critic.train(updated, c.budgets, step))
    with timed("update_actor"):  # 8
        metrics.update(c.actor.train(updated, c.budgets, step))
    with timed("wake_up"):  # 9
        c.engine.wake_up()
    with timed("update_weights"):  # 10
        synced = c.weight_sync.sync(version=step)
    metrics["rollout/weight_sync_bytes"] = synced["rollout/weight_sync_bytes"]
    metrics.update(_step_metrics(t, scores))  # 11
    metrics.update(c.rewards.metrics(reset=True))
    metrics.update(balance)
    metrics.update(rollout)
    metrics.update(c.budgets.metrics())
    metrics["perf/oom_retries"] = float(c.budgets.oom_retries - retries_before)
    timed["timing_s/step"] = time.perf_counter() - step_start
    metrics.update(timed)
    metrics.update(_perf_metrics(c, t, timed))
    return metrics


def _perf_metrics(c: Components, t: Trajectories, timed: Timings) -> dict[str, float]:
    """verl's ``perf/throughput`` (prompt + response tokens per second per device), the actor
    update's achieved TFLOP/s (6 per trained parameter, 4 per frozen one, × tokens × epochs;
    attention not counted; every sample's prompt counted: with ``model.share_prompts`` fewer
    tokens ran; divide by the device's peak for MFU) and peak memory (CUDA: allocated/reserved
    this step; CPU: the process's peak RSS so far)."""
    tokens = float(t.attention_mask.sum())
    out = {"perf/throughput": tokens / timed["timing_s/step"]}
    update = timed.get("timing_s/update_actor")
    if update and c.update_flops_per_token:
        flops = c.update_flops_per_token * tokens * c.actor.epochs
        out["perf/actor_update_tflops"] = flops / update / 1e12
    if default_device().type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        out["perf/max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def calibrate_reward_model(c: Components, items: Sequence[PromptItem]) -> dict[str, float]:
    """Ziegler et al.'s normalization (``reward_model.normalize=reference``): before the first
    update the engine holds the reference policy; sample ``normalize_samples`` responses to
    the first training prompts (``rollout.n`` each, every rank its share), score them, and
    set mean/std so that they score mean 0 / std 1 over all ranks."""
    rm = c.reward_model
    prompts = list(items[: max(1, -(-rm.normalize_samples // c.plan.sampling.config.n))])
    span = rank_span(len(prompts))
    mine, t, _ = _generate(c, prompts[span.start : span.stop], 0, span)
    raw = rm.scoring(t, c.budgets, 0, mine)
    every = concat_over_ranks({"raw": raw.tolist()})["raw"]
    return rm.set_normalization(torch.tensor(every))
