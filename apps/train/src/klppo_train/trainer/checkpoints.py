"""Trainer checkpoints: everything a run needs to continue exactly where it stopped.

``run_dir/checkpoints/global_step_<N>/`` holds ``actor/`` and ``critic/`` (sharded model +
optimizer, :func:`fsdp_sharding.save_checkpoint`) and, with the actor, the trainer state:
step, LR schedulers, KL coefficient, data-loader position, token budgets (as probed or
backed off: a resumed run neither probes again nor forgets a halving) and RNG states. A
step directory is written under a temporary name and renamed into place when complete, so
``resume_mode=auto`` only ever sees whole checkpoints; older ones beyond
``trainer.max_ckpt_to_keep`` are then deleted.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fsdp_sharding import load_checkpoint, save_checkpoint
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.data.datasets import PromptLoader
from klppo_train.ppo.components import Components
from klppo_train.runtime.process_group import barrier, is_main

log = logging.getLogger("klppo_train")
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoints_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published checkpoint, oldest first."""
    root = checkpoints_root(run_dir)
    found = [
        (int(m.group(1)), p) for p in root.glob("global_step_*") if (m := STEP_DIR.match(p.name))
    ]
    return sorted(found)


def trainer_state(c: Components, schedulers: list, loader: PromptLoader, step: int) -> dict:
    """The non-model state; RNG states are this rank's (rank 0's are the ones saved)."""
    return {
        "step": step,
        "schedulers": [s.state_dict() for s in schedulers],
        "kl_coef": float(c.kl_controller.value),
        "loader": loader.state_dict(),
        "budgets": c.budgets.state_dict() if c.budgets is not None else None,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
        },
    }


def save_trainer_checkpoint(
    run_dir: Path, c: Components, schedulers: list, loader: PromptLoader, step: int, keep: int
) -> Path:
    """Write ``global_step_<step>`` atomically (a collective); prune to the newest ``keep``."""
    final = checkpoints_root(run_dir) / f"global_step_{step}"
    tmp = final.with_name(final.name + ".partial")
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    state = trainer_state(c, schedulers, loader, step)
    save_checkpoint(tmp / "actor", c.actor.model, c.actor.optimizer, extra_state=state)
    if c.critic is not None:
        save_checkpoint(tmp / "critic", c.critic.model, c.critic.optimizer)
    if is_main():
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep > 0:  # 0 keeps them all
            for _, old in complete_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    log.info("checkpoint: %s", final)
    return final


def resolve_resume(run_dir: Path, resume_mode: str) -> Path | None:
    """``auto``: the newest checkpoint of the run (or none); ``disable``: none; else a path,
    which must be a checkpoint directory."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume_mode).expanduser()
    if not (path / "actor").is_dir():
        raise FileNotFoundError(
            f"trainer.resume_mode={resume_mode!r}: {path} is not a checkpoint directory "
            "(expected run_dir/checkpoints/global_step_<N> with an actor/ inside)"
        )
    return path


def load_trainer_checkpoint(
    path: Path, c: Components, schedulers: list, loader: PromptLoader
) -> int:
    """Restore everything :func:`save_trainer_checkpoint` wrote; return the step it was at."""
    state: dict[str, Any] = load_checkpoint(path / "actor", c.actor.model, c.actor.optimizer)
    if c.critic is not None:
        load_checkpoint(path / "critic", c.critic.model, c.critic.optimizer)
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    c.kl_controller.value = state["kl_coef"]
    loader.load_state_dict(state["loader"])
    if state.get("budgets") is not None:
        c.budgets = RunBudgets.from_state(state["budgets"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
