"""Rollouts generated ahead of training by a fixed number of steps (``async_training``).

:class:`RolloutsAhead` is a :class:`klppo_train.ppo.rollouts.RolloutSource` over another one
(``inner``: the colocated engine, dynamic sampling, ReMax's): at step k it has ``inner``
generate the batch of step k + s, with the weights the engine holds (version k − 1, the
last update's), and hands the step the batch generated s steps earlier. The schedule is
fixed, not a race: a sample trained at step k > s comes from version k − 1 − s, one of the
first s steps' from the starting weights (version 0), so every sample is at most s versions
behind by construction and a run is reproducible however long each side takes. s = 0 is
the synchronous step (the same calls, the same seeds). Each batch is generated with the
sampling seeds of the step that trains it, whatever s (the weights that sample it differ).

Ordering rules:
    1. The loader gives each step the batch to *generate* (step k + s); the first step
       also generates steps 2 … s + 1 from the next ``more()`` batches, all with version 0
       (after a resume with a larger s, the missing steps likewise).
    2. Nothing is generated for a step after ``last_step``; such a step puts the engine to
       sleep itself (the passes expect its memory free).
    3. A step's metrics are those of the generation it ran (``timing_s/gen``, the engine's
       counters; the last s steps run none: ``timing_s/gen`` 0) plus
       ``async/staleness_{min,mean,max}``: the trained samples' age ``(step − 1) − version``
       in policy versions.
    4. The batches in flight are this source's checkpoint state (every rank's, gathered on
       rank 0: :meth:`state_dict` is a collective), so a resumed run trains what an
       uninterrupted one would; they cannot be regenerated, the weights that made them are
       gone. They resume at the same layout only, and with s no smaller than their number.

Here the engine shares the trainer's ranks, so generation and training still take turns:
this is the algorithm of verl's one-step-off / fully-async trainers (their staleness, their
correction) without their overlap, which needs ranks of their own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from fsdp_sharding import default_device
from klppo_train.config.errors import UserError
from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.rollouts import Collected, OverSource, RolloutSource
from klppo_train.runtime.process_group import SUMS, dp_size, world_size
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
class RolloutsAhead(OverSource):
    """``inner``'s batches, ``lag`` steps ahead (module docstring). ``more()``: the loader's
    next batch; ``engine``: woken between one step's generations and put to sleep on a step
    that generates none (the inner source puts it to sleep after each generation);
    ``last_step``: the run's last (None: no end); ``dataset``: the training prompts (a
    checkpoint names the batches' prompts by their rows)."""

    inner: RolloutSource
    lag: int
    more: Callable[[], Sequence[PromptItem]]
    engine: RolloutEngine
    last_step: int | None = None
    dataset: Sequence[PromptItem] = ()
    ahead: deque[tuple[int, Collected]] = field(default_factory=deque)

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected:
        """Generate every step up to ``step + lag`` not generated yet (one in a steady run;
        s + 1 at the start; more after a resume with a larger s or a longer run), then
        hand over the batch of ``step``."""
        first = self.ahead[-1][0] + 1 if self.ahead else step
        until = step + self.lag if self.last_step is None else min(step + self.lag, self.last_step)
        ran = []  # the metrics of this step's generations
        for later in range(first, until + 1):
            if ran:
                self.engine.wake_up()  # the inner source put it to sleep
            ran.append(self._generate(items if not ran else self.more(), later))
        if not ran:  # the last s steps: nothing to generate, the engine still sleeps
            start = time.perf_counter()
            self.engine.sleep()
            ran.append({"timing_s/gen": 0.0, "timing_s/sleep": time.perf_counter() - start})
        due, trained = self.ahead.popleft()
        if due != step:
            raise RuntimeError(f"rollouts ahead: step {step} found the batch of step {due}")
        metrics = {**_merged(ran), **staleness(trained.trajectories, step)}
        return Collected(
            trained.items, trained.trajectories, metrics, trained.rule, trained.baselines
        )

    def _generate(self, items: Sequence[PromptItem], step: int) -> dict[str, float]:
        collected = self.inner.collect(items, step)
        self.ahead.append((step, collected))
        return collected.metrics

    def state_dict(self) -> dict[str, Any]:
        """Every rank's batches in flight, gathered on rank 0 (which writes the trainer
        state; a collective), as tensors and plain values (the checkpoint is read with
        ``weights_only``), with the layout they were split for."""
        mine = [_plain(due, c) for due, c in self.ahead]
        every: list[Any] = [mine]
        if world_size() > 1:
            every = [None] * world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, every, dst=0)
        return {"ranks": every, "world_size": world_size(), "dp_size": dp_size()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state["ranks"]
        if not any(ranks):  # nothing in flight: any layout, any s
            self.ahead = deque()
            return
        layout = (state["world_size"], state["dp_size"])
        if layout != (world_size(), dp_size()):
            raise UserError(
                "async_training: the checkpoint holds batches generated ahead for "
                f"{layout[0]} ranks ({layout[1]} data-parallel); resume it at that layout "
                f"(this run: {world_size()}, {dp_size()})"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        rows = {item.index: item for item in self.dataset}
        self.ahead = deque(_collected(saved, rows) for saved in ranks[rank])
        if len(self.ahead) > self.lag:
            raise UserError(
                f"async_training.max_staleness_steps={self.lag}: the checkpoint holds "
                f"{len(self.ahead)} batches generated ahead, which would be trained older "
                f"than the bound; resume with max_staleness_steps >= {len(self.ahead)}"
            )


# What a run that keeps nothing in flight says of a checkpoint that does, by the run's kind.
RESUME_ASYNC = "resume it with async_training.enable=true"
RESUME_COLOCATED = (
    "generating ranks of their own (async_training.rollout_ranks) regenerate what was in "
    "flight and cannot take these: resume it with async_training.rollout_ranks=0"
)


@dataclass(frozen=True)
class NothingAhead:
    """The checkpoint state, in place of :class:`RolloutsAhead`'s, of a run that saves no
    batch in flight (a synchronous one, or one whose generating ranks are their own and
    regenerate theirs): a checkpoint that holds batches generated ahead is refused, with
    ``remedy`` (their prompts were taken from the loader already: dropping them would skip
    them)."""

    remedy: str = RESUME_ASYNC

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": [], "world_size": world_size(), "dp_size": dp_size()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if any(state["ranks"]):
            raise UserError(
                "the checkpoint holds batches generated ahead of training on the training "
                f"ranks (async_training); {self.remedy}"
            )


def _merged(ran: list[dict[str, float]]) -> dict[str, float]:
    """The generations' metrics as one: times and counts added up, the rest the last one's."""
    merged = dict(ran[-1])
    for key in merged:
        if key.startswith("timing_s/") or key in SUMS:
            merged[key] = sum(m.get(key, 0.0) for m in ran)
    return merged


def _plain(due: int, c: Collected) -> dict[str, Any]:
    """``c`` as tensors (on the CPU) and plain values; its prompts by their rows."""
    t = {f.name: getattr(c.trajectories, f.name) for f in fields(c.trajectories)}
    plain = {f.name: getattr(c, f.name) for f in fields(c)}
    plain.update(
        items=[i.index for i in c.items],
        trajectories={k: v.cpu() if torch.is_tensor(v) else v for k, v in t.items()},
        metrics=dict(c.metrics),
    )
    return {"step": due, **{k: v.cpu() if torch.is_tensor(v) else v for k, v in plain.items()}}


def _collected(saved: dict[str, Any], rows: dict[int, PromptItem]) -> tuple[int, Collected]:
    device = default_device()
    saved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in saved.items()}
    t = {k: v.to(device) if torch.is_tensor(v) else v for k, v in saved["trajectories"].items()}
    known = {f.name for f in fields(Collected)}
    values = {k: v for k, v in saved.items() if k in known}
    values.update(items=[rows[i] for i in saved["items"]], trajectories=Trajectories(**t))
    return saved["step"], Collected(**values)
