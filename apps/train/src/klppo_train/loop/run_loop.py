"""The one run loop: every task (PPO, reward-model training, a later SFT or evaluation) runs
under it, so every fault it handles is handled for every task.

Numbered, as every rank runs it (``torchrun`` or one process):
  1. process group and signal handlers; rank 0 prepares the run directory (config copy,
     embedded data/model);
  2. the task is built (its models, optimizers, schedulers, data loader: :class:`Task`);
  3. resume from a checkpoint (``trainer.resume_mode``) or validate the starting model;
     :meth:`Task.start` either way (token budgets, calibration, the engine's weights);
  4. per step: :meth:`Task.step` → validation every ``test_freq`` → metrics → checkpoint
     every ``save_freq`` and on preemption (SIGTERM: a checkpoint at the step boundary,
     exit 143: :mod:`klppo_train.loop.preemption`);
  5. the task's export after the last step, plot and summary (rank 0).

At each validation that improves ``trainer.best_metric`` the task also exports its model as
the best (:mod:`klppo_train.loop.best`).

A lost rank (a collective that timed out) is named (:func:`timed_out`) however the task
fails; the task is closed and the process group destroyed however the run ends. The loop
reads no config: :class:`LoopSettings` holds the ``trainer.*`` keys it obeys.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from klppo_train.loop.best import BestStep, greater_is_better
from klppo_train.loop.checkpoints import (
    Stateful,
    load_checkpoint_dir,
    resolve_resume,
    save_checkpoint_dir,
)
from klppo_train.loop.preemption import Preempted, Preemption
from klppo_train.loop.report import PLOTTED, plot_metrics, summarize, summary_text
from klppo_train.runtime.process_group import (
    global_metrics,
    init_distributed,
    is_main,
    timed_out,
)
from klppo_train.tracking.metrics_log import MetricsLog, Tracking

log = logging.getLogger("klppo_train")


class Task(Protocol):
    """What the loop drives. ``label``: the progress bar's; ``shown``: its fields (label →
    metric); ``panels``: the end-of-run plot's; ``total_steps``: the run's length (epochs ×
    batches resolved). The first of :meth:`trainees` holds the trainer state in a
    checkpoint (and names the folder a ``resume_mode`` path must hold). ``best_metric``:
    the validation metric ``trainer.best_metric=auto`` tracks (None: none); ``best_export``:
    the folder :meth:`export_best` writes under the run directory."""

    label: str
    shown: dict[str, str]
    panels: Sequence
    total_steps: int
    best_metric: str | None
    best_export: str

    def trainees(self) -> list: ...

    def states(self) -> dict[str, Stateful]: ...

    def start(self, first: int, run_dir: Path) -> None: ...

    def step(self, step: int) -> dict[str, float]: ...

    def validate(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]: ...

    def export(self, run_dir: Path) -> None: ...

    def export_best(self, run_dir: Path) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoopSettings:
    """The ``trainer.*`` keys the loop obeys (read once, by :meth:`of`)."""

    resume_mode: str
    test_freq: int
    save_freq: int
    stop_at_step: int
    max_ckpt_to_keep: int
    val_before_train: bool
    collective_timeout_s: float
    seed: int
    best_metric: str
    best_greater_is_better: bool | None
    export_best: bool

    @classmethod
    def of(cls, trainer: Any) -> LoopSettings:
        t = trainer
        return cls(
            resume_mode=t.resume_mode, test_freq=t.test_freq, save_freq=t.save_freq,
            stop_at_step=t.stop_at_step, max_ckpt_to_keep=t.max_ckpt_to_keep,
            val_before_train=t.val_before_train, collective_timeout_s=t.collective_timeout_s,
            seed=t.seed, best_metric=t.best_metric,
            best_greater_is_better=t.best_greater_is_better, export_best=t.export_best,
        )  # fmt: skip

    def best(self, task: Task) -> BestStep | None:
        """The tracker of ``best_metric`` (``auto``: the task's); None without one, without
        validation or with ``export_best`` off."""
        metric = task.best_metric if self.best_metric == "auto" else self.best_metric
        if not (self.export_best and self.test_freq and metric):
            return None
        return BestStep(metric, greater_is_better(metric, self.best_greater_is_better))


def due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def run(
    settings: LoopSettings,
    prepare: Callable[[], tuple[Path, Path]],
    build: Callable[[Path], Task],
    tracking: Tracking,
) -> dict:
    """Steps 1–5 for the task ``build(model_dir)`` makes; the summary. ``prepare``: rank
    0 writes the run directory, every rank gets ``(run_dir, model_dir)``."""
    init_distributed(settings.collective_timeout_s)
    task = None
    # The signal handlers from the start (a signal while the models load stops the run
    # before step 1), restored however the run ends.
    with Preemption() as preemption:
        try:
            start = time.perf_counter()
            run_dir, model_dir = prepare()
            torch.manual_seed(settings.seed)
            task = build(model_dir)
            best = settings.best(task)
            metrics_log = _steps(task, settings, run_dir, preemption, tracking, best)
            about = {"best": best.summary(task.best_export)} if best is not None else {}
            return finish(run_dir, metrics_log, start, task.panels, **about)
        except RuntimeError as err:  # a lost rank: say which, not gloo's/NCCL's internals
            lost = timed_out(err, settings.collective_timeout_s)
            if lost is None:
                raise
            raise lost from None
        finally:
            if task is not None:
                task.close()  # vLLM's shutdown destroys the default group; HF's does not
            if dist.is_initialized():
                dist.destroy_process_group()


def _states(task: Task, best: BestStep | None) -> dict[str, Stateful]:
    return {**task.states(), **({"best": best} if best is not None else {})}


def _resume(task: Task, settings: LoopSettings, run_dir: Path, best: BestStep | None) -> int:
    """The step the run continues after (0: a fresh start)."""
    first_trainee = task.trainees()[0].name
    resume_from = resolve_resume(run_dir, settings.resume_mode, first=first_trainee)
    if resume_from is None:
        return 0
    # "best": a checkpoint of an older klppo has none; the tracker then starts afresh.
    # "rollouts_ahead": a synchronous run's has none; the first step generates ahead again
    optional = ("best", "rollouts_ahead")
    return load_checkpoint_dir(resume_from, task.trainees(), _states(task, best), optional)


def _steps(
    task: Task,
    settings: LoopSettings,
    run_dir: Path,
    preemption: Preemption,
    tracking: Tracking,
    best: BestStep | None,
) -> MetricsLog:
    """Resume or validate the start, then the steps (until ``preemption`` agrees to stop:
    :class:`Preempted` after a checkpoint); their record. Each validation that improves
    ``best`` exports the task's model as the best."""
    first = _resume(task, settings, run_dir, best)
    task.start(first, run_dir)
    steps = task.total_steps
    metrics_log = MetricsLog(run_dir, first, steps, tracking, is_main(), task.label, task.shown)

    def validation(step: int) -> dict[str, float]:
        found, rows = task.validate(step)
        metrics_log.log_generations(step, rows)
        if best is not None and best.improves(step, found):
            task.export_best(run_dir)
            name, value = best.metric, best.value
            log.info("best %s: %.4f at step %d: %s", name, value, step, task.best_export)
        return found

    if not first and settings.val_before_train:
        metrics_log.log(0, validation(0))
    last = min(steps, settings.stop_at_step or steps)
    try:  # however the steps end: the bar closed before an error prints, trackers finished
        if preemption.agreed():  # a signal during the start: nothing new to save
            raise Preempted(first, preemption.signal_name)
        for step in range(first + 1, last + 1):
            metrics = task.step(step)
            if settings.test_freq and due(step, settings.test_freq, steps):
                metrics.update(validation(step))
            metrics_log.log(step, global_metrics(metrics))
            stop = preemption.agreed()
            if stop or due(step, settings.save_freq, last):
                trainees, keep = task.trainees(), settings.max_ckpt_to_keep
                protect = best.step if best is not None else None
                metrics_log.sync()
                save_checkpoint_dir(run_dir, trainees, _states(task, best), step, keep, protect)
            if stop:
                raise Preempted(step, preemption.signal_name)
    finally:
        metrics_log.close()
    if last == steps:
        task.export(run_dir)
    return metrics_log


def finish(
    run_dir: Path, metrics_log: MetricsLog, start: float, panels: Sequence = PLOTTED, **about
) -> dict:
    """Plot (``panels``) + summary (with ``about``'s entries) on rank 0 (the others wait);
    the summary is printed with ``console`` among ``trainer.logger``, with one validation
    generation if any."""
    summary: dict = {}
    if is_main():
        records = metrics_log.records
        plot = plot_metrics(records, run_dir / "metrics.png", panels)
        summary = summarize(records, (time.perf_counter() - start) / 60, run_dir, plot)
        summary.update(about)
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, run_dir / "summary.json")
        if "console" in metrics_log.tracking.loggers:
            print(summary_text(summary, _last_sample(metrics_log.generations)), flush=True)
    dist.barrier()
    return summary


def _last_sample(generations: list[dict]) -> dict | None:
    """The last validation step's first generation, if any were recorded."""
    last = generations[-1]["step"] if generations else None
    return next((g for g in generations if g["step"] == last), None)
