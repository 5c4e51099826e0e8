"""Trainer checkpoints: everything a run needs to continue exactly where it stopped.

``run_dir/checkpoints/global_step_<N>/`` holds one folder per trainee (``actor/``,
``critic/``, ``reward_model/``: sharded model + optimizer, :meth:`Trainee.save`) and, with
the first, the trainer state: the step and every :class:`Stateful` of the task
(:meth:`klppo_train.loop.run_loop.Task.states`) -- e.g. each LR
scheduler, the KL controller, the data-loader position, the token budgets (as probed or
backed off: a resumed run neither probes again nor forgets a halving) and the RNG states --
each saving and loading itself (torchtitan's ``Stateful``). A step directory is written
under a temporary name, gets a manifest of its files (sizes, CRC-32:
:mod:`fsdp_sharding.manifest`) written last, and is renamed into place when complete and
verified; older ones beyond ``trainer.max_ckpt_to_keep`` are then deleted. ``resume_mode=auto``
takes the newest checkpoint whose files match its manifest: a damaged one is reported and
skipped, never deleted.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_sharding import has_manifest, verify_manifest, write_manifest
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.config.errors import UserError
from klppo_train.runtime.process_group import (
    PEER_FAILURE,
    LostRank,
    barrier,
    from_main,
    is_main,
    world_size,
)

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
    """The components' token budgets (None before they are chosen: nothing to save), with
    the world size they are for: per-rank budgets saved at another world size are not
    taken (the run chooses them again from the config, probing ``auto`` ones)."""

    def __init__(self, c: Any) -> None:  # anything holding ``budgets``
        self.c = c

    def state_dict(self) -> dict[str, Any]:
        if self.c.budgets is None:
            return {}
        return {**self.c.budgets.state_dict(), "world_size": world_size()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_at = state.get("world_size", world_size())
        if state and saved_at != world_size():
            log.info(
                "token budgets: the checkpoint's are for %d ranks, this run has %d: chosen "
                "again from the config", saved_at, world_size(),
            )  # fmt: skip
        elif state:
            self.c.budgets = RunBudgets.from_state(
                {k: v for k, v in state.items() if k != "world_size"}
            )


def save_checkpoint_dir(
    run_dir: Path,
    trainees: list,
    states: dict[str, Stateful],
    step: int,
    keep: int,
    protect: int | None = None,
) -> Path:
    """``global_step_<step>``: each trainee's folder, the first one's with the step and
    ``states``; written under a temporary name, renamed when whole; the newest ``keep``
    kept, and step ``protect``'s (the best validation's) whatever its age."""
    final = checkpoints_root(run_dir) / f"global_step_{step}"
    tmp = final.with_name(final.name + ".partial")
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    state = {name: s.state_dict() for name, s in states.items()}
    try:
        trainees[0].save(tmp / trainees[0].name, {"step": step, **state})  # the trainer state
        for trainee in trainees[1:]:
            trainee.save(tmp / trainee.name)
    except (OSError, RuntimeError, CheckpointException) as err:  # a full disk, a quota
        raise _unwritten(run_dir, final, tmp, err) from err
    if is_main():
        write_manifest(tmp)  # last: a checkpoint without one was never finished
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        problem = verify_manifest(final)  # read back: pruning then never removes the only
        if problem is not None:  # intact checkpoint
            raise RuntimeError(f"the checkpoint just written does not verify: {problem}")
        if keep > 0:  # 0 keeps them all
            for old_step, old in complete_checkpoints(run_dir)[:-keep]:
                if old_step != protect:
                    shutil.rmtree(old, ignore_errors=True)
    barrier()
    log.info("checkpoint: %s", final)
    return final


def _unwritten(run_dir: Path, final: Path, tmp: Path, err: BaseException) -> Exception:
    """A save that failed (torch reports a full disk as a failed write inside its zip
    writer, DCP wraps it): the partial directory removed, the previous checkpoints as they
    were; the error names the path. A save that failed because another rank died in it is
    a :class:`LostRank`, not a full disk."""
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    found = complete_checkpoints(run_dir)
    kept = f"the previous checkpoint ({found[-1][1]}) is intact" if found else "none was kept"
    text = str(err).strip()
    lost = PEER_FAILURE.search(text)
    if lost:
        peer = lost.group(0)
        return LostRank(
            f"checkpoint {final} was not finished: another rank was lost while it was saved "
            f"({peer}); {kept}: resume_mode=auto continues from it"
        )
    cause = text.splitlines()[-1] if text else type(err).__name__
    return UserError(
        f"checkpoint {final} could not be written ({cause}); is the disk full? {kept}: "
        "free space and run again to resume"
    )


def resolve_resume(run_dir: Path, resume_mode: str, first: str = "actor") -> Path | None:
    """``auto``: the newest checkpoint of the run (or none); ``disable``: none; else a path,
    which must be a checkpoint directory (with the ``first`` trainee's folder inside)."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":  # rank 0 reads the files; every rank takes its answer
        return from_main(newest_intact(run_dir) if is_main() else None)
    path = Path(resume_mode).expanduser()
    if not (path / first).is_dir():
        raise FileNotFoundError(
            f"trainer.resume_mode={resume_mode!r}: {path} is not a checkpoint directory "
            f"(expected run_dir/checkpoints/global_step_<N> with a {first}/ inside)"
        )
    return path


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` (None: intact). One written before manifests
    existed cannot be verified: it is taken as it is, with a log line."""
    if not has_manifest(path):
        log.info("checkpoint %s has no manifest (an older klppo wrote it): not verified", path)
        return None
    return verify_manifest(path)


def newest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint of the run whose files match its manifest. Each damaged newer
    one is reported and renamed ``<name>.damaged`` (kept for inspection, out of the way of
    the resumed run's own save of that step and of the retention)."""
    for _, path in reversed(complete_checkpoints(run_dir)):
        problem = damage(path)
        if problem is None:
            return path
        kept = path.with_name(f"{path.name}.damaged")
        shutil.rmtree(kept, ignore_errors=True)  # an older one of the same step
        path.rename(kept)
        log.warning("checkpoint %s is damaged (%s): skipped, kept as %s", path, problem, kept)
    return None


def load_checkpoint_dir(
    path: Path, trainees: list, states: dict[str, Stateful], optional: tuple[str, ...] = ()
) -> int:
    """Restore what :func:`save_checkpoint_dir` wrote; return the step it was at. The
    ``optional`` states may be missing (older checkpoints): they keep their fresh state."""
    state: dict[str, Any] = trainees[0].load(path / trainees[0].name)  # the trainer state
    for trainee in trainees[1:]:
        trainee.load(path / trainee.name)
    for name, saved in states.items():
        if name in state or name not in optional:
            saved.load_state_dict(state[name])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
