"""Rollouts generated ahead of training by a fixed number of steps (``async_training``).

:class:`RolloutsAhead` is a :class:`klppo_train.ppo.rollouts.RolloutSource` over another one
(``inner``: the colocated engine, dynamic sampling, ReMax's): at step k it has ``inner``
generate the batch of step k + s, with the weights the engine holds (version k − 1, the
last update's), and hands the step the batch generated s steps earlier. The schedule is
fixed, not a race: a sample trained at step k > s comes from version k − 1 − s, one of the
first s steps' from the starting weights (version 0), so every sample is at most s versions
behind by construction and a run is reproducible however long each side takes. s = 0 is
the synchronous step (the same calls, the same seeds). Each batch is generated as the step
that trains it (its sampling seeds are that step's), so the samples do not depend on s.

Ordering rules:
    1. The loader gives each step the batch to *generate* (step k + s); the first step
       also generates steps 1 … s from the next ``more()`` batches, all with version 0.
    2. Nothing is generated for a step after ``last_step``.
    3. A step's metrics are those of the generation it ran (``timing_s/gen``, the engine's
       counters; the last s steps run none: ``timing_s/gen`` 0) plus
       ``async/staleness_{min,mean,max}``: the trained samples' age ``(step − 1) − version``
       in policy versions.
    4. The batches in flight are this source's checkpoint state (every rank's, gathered:
       :meth:`state_dict` is a collective), so a resumed run trains what an uninterrupted
       one would; they cannot be regenerated, the weights that made them are gone.

Here the engine shares the trainer's ranks, so generation and training still take turns:
this is the algorithm of verl's one-step-off / fully-async trainers (their staleness, their
correction) without their overlap, which needs ranks of their own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from fsdp_sharding import default_device
from klppo_train.config.errors import UserError
from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.rollouts import Collected, RolloutSource
from klppo_train.runtime.process_group import SUMS, world_size
from klppo_train.workers.trajectories import Trajectories
from rollout import RolloutEngine


def staleness(t: Trajectories, step: int) -> dict[str, float]:
    """``async/staleness_{min,mean,max}``: how many versions the samples of ``t`` lag the
    weights that update ``step`` trains (version ``step − 1``)."""
    versions = t.sample_versions
    if versions is None:
        versions = torch.full((t.response_mask.shape[0],), t.policy_version)
    age = (step - 1 - versions).float()
    return {
        "async/staleness_min": float(age.min()),
        "async/staleness_mean": float(age.mean()),
        "async/staleness_max": float(age.max()),
    }


@dataclass
class RolloutsAhead:
    """``inner``'s batches, ``lag`` steps ahead (module docstring). ``more()``: the loader's
    next batch; ``engine``: woken between the first step's generations (the inner source
    puts it to sleep after each); ``last_step``: the run's last (None: no end)."""

    inner: RolloutSource
    lag: int
    more: Callable[[], Sequence[PromptItem]]
    engine: RolloutEngine
    last_step: int | None = None
    ahead: deque[tuple[int, Collected]] = field(default_factory=deque)

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected:
        ran: list[dict[str, float]] = []  # the metrics of this step's generations
        if not self.ahead:  # a fresh start (or a synchronous checkpoint): steps step … step+s
            ran.append(self._generate(items, step))
            for later in range(step + 1, step + self.lag + 1):
                if self._ends_before(later):
                    break
                self.engine.wake_up()
                ran.append(self._generate(self.more(), later))
        elif not self._ends_before(step + self.lag):
            ran.append(self._generate(items, step + self.lag))
        due, trained = self.ahead.popleft()
        if due != step:
            raise RuntimeError(f"rollouts ahead: step {step} found the batch of step {due}")
        metrics = {**_merged(ran), **staleness(trained.trajectories, step)}
        return Collected(
            trained.items, trained.trajectories, metrics, trained.rule, trained.baselines
        )

    def _ends_before(self, step: int) -> bool:
        return self.last_step is not None and step > self.last_step

    def _generate(self, items: Sequence[PromptItem], step: int) -> dict[str, float]:
        collected = self.inner.collect(items, step)
        self.ahead.append((step, collected))
        return collected.metrics

    def publish(self, version: int) -> dict[str, float]:
        return self.inner.publish(version)

    def resume(self, version: int) -> None:
        self.inner.resume(version)

    def generate(self, items: Sequence[PromptItem], step: int, span: range):
        return self.inner.generate(items, step, span)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's batches in flight (a collective), as tensors and plain values (the
        checkpoint is read with ``weights_only``)."""
        mine = [_plain(due, c) for due, c in self.ahead]
        if world_size() == 1:
            return {"ranks": [mine]}
        every: list[Any] = [None] * world_size()
        dist.all_gather_object(every, mine)
        return {"ranks": every}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state["ranks"]
        if len(ranks) != world_size():
            raise UserError(
                f"async_training: the checkpoint holds batches generated ahead for "
                f"{len(ranks)} ranks; resume it at that world size (this run has {world_size()})"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.ahead = deque(_collected(saved) for saved in ranks[rank])


def _merged(ran: list[dict[str, float]]) -> dict[str, float]:
    """The generations' metrics as one: times and counts added up, the rest the last one's."""
    merged = dict(ran[-1]) if ran else {"timing_s/gen": 0.0}  # the last s steps: none
    for key in merged:
        if key.startswith("timing_s/") or key in SUMS:
            merged[key] = sum(m.get(key, 0.0) for m in ran)
    return merged


def _plain(due: int, c: Collected) -> dict[str, Any]:
    t = {f.name: getattr(c.trajectories, f.name) for f in fields(c.trajectories)}
    items = [{f.name: getattr(i, f.name) for f in fields(i)} for i in c.items]
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in t.items()}
    return {
        "step": due,
        "items": items,
        "trajectories": cpu,
        "metrics": dict(c.metrics),
        "rule": None if c.rule is None else c.rule.cpu(),
        "baselines": None if c.baselines is None else c.baselines.cpu(),
    }


def _collected(saved: dict[str, Any]) -> tuple[int, Collected]:
    device = default_device()
    t = {k: v.to(device) if torch.is_tensor(v) else v for k, v in saved["trajectories"].items()}

    def moved(v):
        return None if v is None else v.to(device)

    items = [PromptItem(**i) for i in saved["items"]]
    collected = Collected(
        items, Trajectories(**t), saved["metrics"], moved(saved["rule"]), moved(saved["baselines"])
    )
    return saved["step"], collected
