"""The training run: PPO steps over the prompt loader, validation, checkpoints, reports.

Numbered, as every rank runs it (``torchrun`` or one process):
  1. process group; rank 0 prepares the run directory (config copy, embedded data/model);
  2. build the components (sharded models, optimizers, engine, weight sync);
  3. resume from a checkpoint (``trainer.resume_mode``; its token budgets too) or choose the
     token budgets (``auto`` ones probed, :mod:`klppo_train.budgets.probe`) and validate the
     starting policy;
  4. per step: ``ppo_step`` → LR schedulers → validation every ``test_freq`` → metrics →
     checkpoint every ``save_freq`` (and on preemption: :mod:`klppo_train.trainer.preemption`);
  5. final checkpoint and HF export of the actor, plot and summary (rank 0).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from klppo_train.budgets.probe import choose_budgets
from klppo_train.budgets.run_budgets import BUDGETS_FILE
from klppo_train.cli import launch_world_size
from klppo_train.config.preflight import Checked, preflight
from klppo_train.config.schema import AppConfig, TrainerConfig, to_yaml
from klppo_train.data.datasets import PromptLoader
from klppo_train.ppo.components import Components
from klppo_train.ppo.step import calibrate_reward_model, ppo_step
from klppo_train.runtime.process_group import (
    global_metrics,
    init_distributed,
    is_main,
    timed_out,
)
from klppo_train.tracking.metrics_log import MetricsLog, Tracking
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.build import build_components, ensure_model_dir
from klppo_train.trainer.checkpoints import (
    load_trainer_checkpoint,
    resolve_resume,
    save_trainer_checkpoint,
)
from klppo_train.trainer.preemption import Preempted, Preemption
from klppo_train.trainer.report import (
    PLOTTED,
    plot_metrics,
    summarize,
    summary_text,
)
from klppo_train.trainer.validation import validate

log = logging.getLogger("klppo_train")


def total_steps(trainer: TrainerConfig, batches_per_epoch: int) -> int:
    return trainer.total_training_steps or trainer.total_epochs * batches_per_epoch


def prepare_run_dir(cfg: AppConfig, subdir: str = "") -> tuple[Path, Path]:
    """``(run_dir, model_dir)``; rank 0 writes (the config's copy in ``run_dir/subdir``),
    the others wait for it."""
    run_dir = Path(cfg.trainer.run_dir).expanduser()
    if is_main():
        (run_dir / subdir).mkdir(parents=True, exist_ok=True)
        (run_dir / subdir / "config.yaml").write_text(to_yaml(cfg))
        ensure_model_dir(cfg, run_dir)
    dist.barrier()
    return run_dir, ensure_model_dir(cfg, run_dir)  # now only finds it


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def train(cfg: AppConfig, checked: Checked | None = None) -> dict:
    """Run the configured PPO steps (resuming if asked); return the summary. ``checked``:
    what :func:`klppo_train.config.preflight.preflight` returned (run here when not given).
    Engine and process group are closed however the run ends."""
    checked = checked or preflight(cfg, launch_world_size())
    init_distributed(cfg.trainer.collective_timeout_s)
    c = None
    # The signal handlers from the start (a signal while the models load stops the run
    # before step 1), restored however the run ends.
    with Preemption() as preemption:
        try:
            start = time.perf_counter()
            run_dir, model_dir = prepare_run_dir(cfg)
            torch.manual_seed(cfg.trainer.seed)
            c = build_components(
                cfg, model_dir, checked.tokenizer, checked.rewards, checked.rm_tokenizer
            )
            metrics_log = _steps(c, cfg, checked, run_dir, preemption)
            return finish(run_dir, metrics_log, start)
        except RuntimeError as err:  # a lost rank: say which, not gloo's/NCCL's internals
            lost = timed_out(err, cfg.trainer.collective_timeout_s)
            if lost is None:
                raise
            raise lost from None
        finally:
            if c is not None:
                c.engine.close()  # vLLM's shutdown destroys the default group; HF's does not
            if dist.is_initialized():
                dist.destroy_process_group()


def _token_budgets(c: Components, builder: StepBuilder, run_dir: Path) -> None:
    """A checkpoint's budgets, else the config's with ``auto`` ones probed; in
    ``run_dir/budgets.json`` (rank 0)."""
    path = run_dir / BUDGETS_FILE if is_main() else None
    if c.budgets is None:
        c.budgets = choose_budgets(c, builder.configured_budgets(), builder.probe_shape(), path)
    else:
        c.budgets.path = path
        c.budgets.write()
        log.info("token budgets from the checkpoint: %s", c.budgets.tokens)


NORMALIZATION_FILE = "reward_normalization.json"  # in the run directory


def _calibrate(c: Components, items, run_dir: Path) -> None:
    """``reward_model.normalize=reference``: measured before step 1, kept in the run
    directory (and the checkpoints)."""
    found = calibrate_reward_model(c, items)
    log.info(
        "reward model normalized on %d reference samples: mean %.4f, std %.4f",
        found["samples"], found["mean"], found["std"],
    )  # fmt: skip
    if is_main():
        tmp = run_dir / (NORMALIZATION_FILE + ".tmp")
        tmp.write_text(json.dumps(found, indent=2))
        os.replace(tmp, run_dir / NORMALIZATION_FILE)


def _steps(
    c: Components, cfg: AppConfig, checked: Checked, run_dir: Path, preemption: Preemption
) -> MetricsLog:
    """Resume or validate the start, then the PPO steps (until ``preemption`` agrees to
    stop: :class:`Preempted` after a checkpoint); their record."""
    train_set, val_set = checked.train, checked.val
    loader = PromptLoader(train_set, cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
    steps = total_steps(cfg.trainer, len(loader))
    builder = StepBuilder(cfg)
    schedulers = builder.schedulers(c, steps)
    resume_from = resolve_resume(run_dir, cfg.trainer.resume_mode)
    first = load_trainer_checkpoint(resume_from, c, schedulers, loader) if resume_from else 0
    _token_budgets(c, builder, run_dir)
    if first:
        c.weight_sync.sync(version=first)
    elif c.reward_model is not None and c.reward_model.normalize == "reference":
        _calibrate(c, train_set.items, run_dir)
    tracking = Tracking.from_config(cfg)
    metrics_log = MetricsLog(run_dir, first, steps, tracking, enabled=is_main())

    def validation(step: int) -> dict[str, float]:
        found, rows = validate(c, val_set.items, cfg.data.val_batch_size, tracking.generations)
        metrics_log.log_generations(step, rows)
        return found

    if not first and cfg.trainer.val_before_train:
        metrics_log.log(0, validation(0))
    last = min(steps, cfg.trainer.stop_at_step or steps)
    keep = cfg.trainer.max_ckpt_to_keep
    try:  # however the steps end: the bar closed before an error prints, trackers finished
        if preemption.agreed():  # a signal during the start: nothing new to save
            raise Preempted(first, preemption.signal_name)
        for step in range(first + 1, last + 1):
            metrics = ppo_step(c, loader.next_batch(), step)
            for scheduler in schedulers:
                scheduler.step()
            if cfg.trainer.test_freq and _due(step, cfg.trainer.test_freq, steps):
                metrics.update(validation(step))
            metrics_log.log(step, global_metrics(metrics))
            stop = preemption.agreed()
            if stop or _due(step, cfg.trainer.save_freq, last):
                save_trainer_checkpoint(run_dir, c, schedulers, loader, step, keep)
            if stop:
                raise Preempted(step, preemption.signal_name)
    finally:
        metrics_log.close()
    if last == steps and c.export_actor is not None:
        c.export_actor(run_dir)
    return metrics_log


def finish(run_dir: Path, metrics_log: MetricsLog, start: float, panels=PLOTTED, **about) -> dict:
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
