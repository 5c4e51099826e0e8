"""A run's directory and length, the same for every task."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from klppo_train.config.schema import AppConfig, TrainerConfig, to_yaml
from klppo_train.runtime.process_group import is_main
from klppo_train.trainer.build import ensure_model_dir


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
