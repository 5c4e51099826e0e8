"""Trainer checkpoints: everything a run needs to continue exactly where it stopped.

``run_dir/checkpoints/global_step_<N>/`` holds one folder per trainee (``actor/``,
``critic/``: sharded model + optimizer, :meth:`Trainee.save`) and, with the actor, the
trainer state: the step and every :class:`Stateful` of :func:`stateful` -- each LR
scheduler, the KL controller, the data-loader position, the token budgets (as probed or
backed off: a resumed run neither probes again nor forgets a halving) and the RNG states --
each saving and loading itself (torchtitan's ``Stateful``). A step directory is written
under a temporary name and renamed into place when complete, so ``resume_mode=auto`` only
ever sees whole checkpoints; older ones beyond ``trainer.max_ckpt_to_keep`` are then
deleted.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

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


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGStates:
    """This rank's torch and Python RNG states (rank 0's are the ones saved)."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])


class BudgetsInForce:
    """The components' token budgets (None before they are chosen: nothing to save)."""

    def __init__(self, c: Any) -> None:  # anything holding ``budgets``
        self.c = c

    def state_dict(self) -> dict[str, Any]:
        return self.c.budgets.state_dict() if self.c.budgets is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.c.budgets = RunBudgets.from_state(state)


def stateful(c: Components, schedulers: list, loader: PromptLoader) -> dict[str, Stateful]:
    """Everything besides the trainees' models and optimizers that a resumed run needs, by
    the name it is saved under (``schedulers``: one per trainee, in the same order)."""
    lr = {f"lr_scheduler/{t.name}": s for t, s in zip(c.trainees(), schedulers, strict=True)}
    rm = {"reward_model": c.reward_model} if c.reward_model is not None else {}
    return {
        **lr,
        "kl_controller": c.kl_controller,
        "loader": loader,
        "budgets": BudgetsInForce(c),
        "rng": RNGStates(),
        **rm,  # the reward normalization in force
    }


def save_trainer_checkpoint(
    run_dir: Path, c: Components, schedulers: list, loader: PromptLoader, step: int, keep: int
) -> Path:
    """Write ``global_step_<step>`` atomically (a collective); prune to the newest ``keep``."""
    return save_checkpoint_dir(run_dir, c.trainees(), stateful(c, schedulers, loader), step, keep)


def save_checkpoint_dir(
    run_dir: Path, trainees: list, states: dict[str, Stateful], step: int, keep: int
) -> Path:
    """``global_step_<step>``: each trainee's folder, the first one's with the step and
    ``states``; written under a temporary name, renamed when whole; the newest ``keep``
    kept."""
    final = checkpoints_root(run_dir) / f"global_step_{step}"
    tmp = final.with_name(final.name + ".partial")
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    state = {name: s.state_dict() for name, s in states.items()}
    trainees[0].save(tmp / trainees[0].name, {"step": step, **state})  # the trainer state
    for trainee in trainees[1:]:
        trainee.save(tmp / trainee.name)
    if is_main():
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep > 0:  # 0 keeps them all
            for _, old in complete_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    log.info("checkpoint: %s", final)
    return final


def resolve_resume(run_dir: Path, resume_mode: str, first: str = "actor") -> Path | None:
    """``auto``: the newest checkpoint of the run (or none); ``disable``: none; else a path,
    which must be a checkpoint directory (with the ``first`` trainee's folder inside)."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume_mode).expanduser()
    if not (path / first).is_dir():
        raise FileNotFoundError(
            f"trainer.resume_mode={resume_mode!r}: {path} is not a checkpoint directory "
            f"(expected run_dir/checkpoints/global_step_<N> with a {first}/ inside)"
        )
    return path


def load_trainer_checkpoint(
    path: Path, c: Components, schedulers: list, loader: PromptLoader
) -> int:
    """Restore everything :func:`save_trainer_checkpoint` wrote; return the step it was at."""
    return load_checkpoint_dir(path, c.trainees(), stateful(c, schedulers, loader))


def load_checkpoint_dir(path: Path, trainees: list, states: dict[str, Stateful]) -> int:
    """Restore what :func:`save_checkpoint_dir` wrote; return the step it was at."""
    state: dict[str, Any] = trainees[0].load(path / trainees[0].name)  # the trainer state
    for trainee in trainees[1:]:
        trainee.load(path / trainee.name)
    for name, saved in states.items():
        saved.load_state_dict(state[name])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
