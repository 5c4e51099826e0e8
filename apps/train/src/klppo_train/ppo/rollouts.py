"""Where a step's trajectories come from: a :class:`RolloutSource`, and the one in use today,
:class:`ColocatedRollouts` (the engine on this rank, sleeping while the trainer trains); how
they are sampled and laid out (:class:`StepPlan`).

A step is ``source.collect(prompts, step)`` → :func:`klppo_train.ppo.step.train_on` (which
never touches an engine) → ``source.publish(step)``. Each sample keeps the policy version of
the weights that generated it (:attr:`Trajectories.sample_versions`), so whoever trains on
it can tell on-policy samples from older ones; a source that runs ahead of training
(``async_training``: :class:`klppo_train.ppo.rollouts_ahead.RolloutsAhead`) is another
object behind the same Protocol.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fsdp_sharding import default_device
from klppo_train.agents.samplers import Sampler
from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.balance import balance_rollouts
from klppo_train.runtime.engine import RolloutStats, Sampling
from klppo_train.runtime.process_group import rank_span
from klppo_train.runtime.sequence_parallel import SequenceParallel, shared
from klppo_train.workers.trajectories import Trajectories, trajectories
from rollout import RolloutBatch, RolloutEngine, WeightPublisher


@dataclass(frozen=True)
class StepPlan:
    """What a step does besides its passes: how it samples (``rollout.sampling`` and the
    seeds), the responses' fixed width ``response_length`` (T), whether the ranks
    re-split their rollouts by tokens (``trainer.balance_batch``), and the sequence-parallel
    group whose ranks train on the same rollouts (``sp``)."""

    sampling: Sampling
    response_length: int
    balance_batch: bool = True
    sp: SequenceParallel = SequenceParallel()


@dataclass(frozen=True)
class Collected:
    """One step's rollouts on this rank: its prompts (``items``, indexed by the
    trajectories' ``prompt_index``), the trajectories, and the collection's metrics
    (``timing_s/gen``, ``timing_s/sleep``, balance, the engine's counters); ``rule``: their
    rule rewards ``[N]`` where the source scored them (dynamic sampling), else None;
    ``baselines``: ``[N]`` the reward of a greedy answer to each sample's prompt (ReMax)."""

    items: list[PromptItem]
    trajectories: Trajectories
    metrics: dict[str, float]
    rule: torch.Tensor | None = None
    baselines: torch.Tensor | None = None


class RolloutSource(Protocol):
    """What a step takes its trajectories from and gives its new weights to.

    Contract: every rank calls :meth:`collect` and :meth:`publish` at the same points (they
    may hold collectives); ``collect(items, step)`` gets the step's whole batch of prompts
    and returns this rank's share; ``publish(version)`` is called after the optimizer steps
    of update ``version`` and before the next ``collect``."""

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected: ...

    def publish(self, version: int) -> dict[str, float]: ...

    def resume(self, version: int) -> None:
        """A resumed run's restored weights become the generating side's, as ``version``."""
        ...

    def generate(self, items: Sequence[PromptItem], step: int, span: range):
        """``(items, trajectories, metrics)``: samples of the current weights for this
        rank's ``items`` (the step's prompts ``span``), outside a step (the reward
        model's calibration)."""
        ...


@dataclass
class ColocatedRollouts:
    """The engine on this rank generates each step's samples with the weights of the
    previous step, then sleeps (frees its accelerator memory, verl's ``free_cache_engine``)
    while the trainer trains; :meth:`publish` wakes it and syncs the new weights."""

    engine: RolloutEngine
    publisher: WeightPublisher
    plan: StepPlan
    pad_token_id: int
    sampler: Sampler  # the engine's single turn, or conversations with tools over it
    stats: RolloutStats | None = None  # vLLM's counters per step (log stats on)
    sleeps: bool = True  # False on a generating rank of its own: no trainer needs the memory

    def generate(self, items: Sequence[PromptItem], step: int, span: range):
        """``(items, trajectories, metrics)``: rollouts of this rank's ``items`` (the
        step's prompts ``span``), re-split over the ranks by tokens when
        ``trainer.balance_batch``; the sampler's metrics (multi-turn) and the balance's."""
        batch = self.sample(items, step, span)
        items, t, metrics, _ = self.lay_out(items, batch, list(span))
        return items, t, metrics | self.sampler.metrics(batch)

    def sample(self, items: Sequence[PromptItem], step: int, span: Sequence[int]) -> RolloutBatch:
        """The sampler's samples of this rank's ``items`` (the step's prompts ``span``:
        their positions, which seed them)."""
        batch = self.sampler.sample(
            items,
            self.plan.sampling.for_step(step),
            seeds=self.plan.sampling.request_seeds(step, span),
        )
        return shared(batch, self.plan.sp)

    def lay_out(
        self,
        items: Sequence[PromptItem],
        batch: RolloutBatch,
        positions: list[int],
        canonical: Sequence[int] | None = None,
        rebalance: bool | None = None,
    ):
        """``(items, trajectories, balance metrics, positions)``: samples as trajectories,
        re-split over the ranks by tokens when ``rebalance`` (default
        ``trainer.balance_batch``; a collective). ``positions``: the prompts' among the
        ranks' prompts in rank order (after the re-split, the returned ones); ``canonical``:
        each such position's place in the step's batch where the two differ (dynamic
        sampling's kept prompts)."""
        balance: dict[str, float] = {}
        if self.plan.balance_batch if rebalance is None else rebalance:
            items, batch, balance, positions = balance_rollouts(items, batch)
        placed = positions if canonical is None else [canonical[p] for p in positions]
        t = trajectories(
            [i.prompt_ids for i in items],
            batch,
            pad_token_id=self.pad_token_id,
            response_length=self.plan.response_length,
            device=default_device(),
            positions=placed,
        )
        return list(items), t, balance, positions

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected:
        span = rank_span(len(items))
        start = time.perf_counter()
        counted = self.stats.counts() if self.stats else {}
        mine, t, metrics = self.generate(items[span.start : span.stop], step, span)
        metrics.update(self.stats.since(counted) if self.stats else {})
        metrics["timing_s/gen"] = time.perf_counter() - start
        metrics.update(self.rest())
        return Collected(mine, t, metrics)

    def rest(self) -> dict[str, float]:
        """The engine sleeps (frees its GPU memory for the passes) once the step's samples
        are in: ``timing_s/sleep``."""
        if not self.sleeps:
            return {}
        start = time.perf_counter()
        self.engine.sleep()
        return {"timing_s/sleep": time.perf_counter() - start}

    def resume(self, version: int) -> None:
        self.publisher.sync(version=version)

    def publish(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        self.engine.wake_up()
        metrics = {"timing_s/wake_up": time.perf_counter() - start}
        start = time.perf_counter()
        synced = self.publisher.sync(version=version)
        metrics["timing_s/update_weights"] = time.perf_counter() - start
        metrics["rollout/weight_sync_bytes"] = synced["rollout/weight_sync_bytes"]
        return metrics


@dataclass
class OverSource:
    """The base of a rollout source that changes how ``inner`` collects a step's samples
    and leaves publishing, resuming and generating outside a step to it."""

    inner: RolloutSource

    def publish(self, version: int) -> dict[str, float]:
        return self.inner.publish(version)

    def resume(self, version: int) -> None:
        self.inner.resume(version)

    def generate(self, items: Sequence[PromptItem], step: int, span: range):
        return self.inner.generate(items, step, span)


@dataclass
class OverColocated(OverSource):
    """An :class:`OverSource` over the colocated engine (dynamic sampling, ReMax's greedy
    baselines): it puts the engine to sleep itself (``inner.rest()``) once its samples are in."""

    inner: ColocatedRollouts
