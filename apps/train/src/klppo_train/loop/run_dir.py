"""A run's directory and length, and a task run under the loop with the config's settings:
the same for every task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from klppo_train.config.schema import AppConfig, TrainerConfig, to_yaml
from klppo_train.data import sources
from klppo_train.data.datasets import read_rows
from klppo_train.loop import run_loop
from klppo_train.loop.run_loop import LoopSettings, Task
from klppo_train.runtime.process_group import is_main
from klppo_train.tracking.metrics_log import Tracking


def run_task(cfg: AppConfig, build: Callable[[Path], Task]) -> dict:
    """The task ``build(model_dir)`` makes, under :func:`klppo_train.loop.run_loop.run` with
    the config's ``trainer.*`` settings and trackers; the summary."""
    return run_loop.run(
        LoopSettings.of(cfg.trainer),
        lambda: prepare_run_dir(cfg),
        build,
        Tracking.of(cfg.trainer, asdict(cfg)),
    )


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


def ensure_model_dir(cfg: AppConfig, run_dir: Path) -> Path:
    """The HF directory of the actor: the recipe's, or the embedded model (built, warmed up
    and cached in ``run_dir/model``)."""
    if cfg.model.path:  # checked by preflight
        return Path(cfg.model.path).expanduser()
    path = run_dir / "model"
    if (path / "config.json").exists():
        return path
    # Warm-up stops on accuracy over training rows the PPO phase will also see (never val).
    return sources.embedded().model(
        path,
        train_rows=read_rows(cfg.data.train_files),
        warmup_steps=cfg.model.warmup_steps,
        target_accuracy=cfg.model.warmup_target_accuracy,
        seed=cfg.trainer.seed,
    )
