"""Shared by the benchmarks (each run as ``python benchmarks/<name>.py``, so this folder is on
``sys.path``): where results go and how they are written, and the allocator they time with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(data: Any, out: Path) -> None:
    """Write ``data`` as JSON to ``out`` atomically (never a half-written result) and say so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(out)
    print(f"wrote {out}")


def with_trainer_allocator() -> None:
    """Give this benchmark the allocator a training run has (``trainer.allocator=auto``:
    re-executed with tcmalloc where the system has it, else glibc's malloc told in place to
    keep freed memory), so that what it times in its own process is timed as in a run
    (glibc's default malloc page-faults large tensors in again on every pass: SmolLM2's bf16
    packed forward of 16k tokens, 11.7 s vs 6.5 s)."""
    from klppo_train.runtime.allocator import use_allocator

    use_allocator("auto")


def child_env(allocator: str | None) -> dict[str, str]:
    """The environment for a child process that starts with ``allocator`` (a
    ``trainer.allocator`` value), whatever this process runs with; ``None``: none chosen here
    (a trainer child then follows its own ``trainer.allocator``)."""
    from klppo_train.runtime.allocator import allocator_env, without_allocator

    env = without_allocator(dict(os.environ))
    return env if allocator is None else allocator_env(allocator, env)


def steady_index(step_seconds: list[float]) -> int:
    """Index of the step a benchmark reports: the median, by time, of all steps but the first
    (which pays one-off costs; the allocator's heap also grows over the first two), the
    upper one of two; the only step when there is one."""
    later = sorted(range(1, len(step_seconds)), key=step_seconds.__getitem__)
    return later[len(later) // 2] if later else 0
