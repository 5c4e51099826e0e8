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
    """Re-execute this benchmark with the allocator a training run has
    (``trainer.allocator=auto``: tcmalloc where the system has it), so that what it times in
    its own process is timed as in a run (glibc's malloc page-faults large tensors in again
    on every pass: SmolLM2's bf16 packed forward of 16k tokens, 11.7 s vs 6.5 s)."""
    from klppo_train.allocator import reexec_with_tcmalloc

    reexec_with_tcmalloc("auto")


def child_env(tcmalloc: bool) -> dict[str, str]:
    """The environment for a child process, with tcmalloc preloaded or not, whatever this
    process runs with (a trainer child given ``tcmalloc=False`` then follows its own
    ``trainer.allocator``)."""
    from klppo_train.allocator import REEXECUTED_ENV, find_tcmalloc

    preload = [lib for lib in os.environ.get("LD_PRELOAD", "").split() if "tcmalloc" not in lib]
    if tcmalloc and (library := find_tcmalloc()):
        preload.insert(0, library)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXECUTED_ENV)}
    return {**env, "LD_PRELOAD": " ".join(preload)} if preload else env
