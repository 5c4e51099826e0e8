"""The process's memory allocator: tcmalloc where the system has it (``trainer.allocator``).

Why: a PPO step allocates and frees gigabytes of activations, log-prob chunks and gradients.
glibc's malloc hands blocks over 32 MiB back to the kernel on free, so every step
page-faults its memory in again (a SmolLM2 critic update: 650k minor faults, 6.4 s of system
time in 8.7 s), and ``MALLOC_*`` tunables did not change the steady state. tcmalloc keeps
freed memory for reuse: SmolLM2-135M, bf16, 16 prompts × 4 × ≤ 64 tokens, steady steps
21.7 → 17.7 s on 2 CPU cores (vLLM-CPU recommends the same). It can only be chosen before
the process starts (``LD_PRELOAD``), so the command line re-executes itself once with it.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("klppo_train")

ALLOCATORS = ("auto", "tcmalloc", "system")
LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
REEXECUTED_ENV = "KLPPO_ALLOCATOR_REEXECUTED"


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library's name as the dynamic loader finds it, or None."""
    for name in LIBRARIES:
        if found := ctypes.util.find_library(name):
            return found
    return None


def tcmalloc_loaded() -> bool:
    maps = Path("/proc/self/maps")
    return maps.is_file() and "libtcmalloc" in maps.read_text()


def check_allocator(setting: str) -> None:
    """Raise ``ValueError`` naming ``trainer.allocator`` when it cannot be honoured."""
    if setting not in ALLOCATORS:
        raise ValueError(f"trainer.allocator={setting!r}; valid: {', '.join(ALLOCATORS)}")
    if setting == "tcmalloc" and not (tcmalloc_loaded() or find_tcmalloc()):
        raise ValueError(
            "trainer.allocator=tcmalloc: no libtcmalloc on this system "
            "(Debian/Ubuntu: apt install libtcmalloc-minimal4), or use auto/system"
        )


def reexec_with_tcmalloc(setting: str) -> None:
    """Replace this process by the same command with tcmalloc preloaded, when ``setting``
    asks for it (``auto``: if the library exists) and it is not loaded yet. Returns only when
    nothing is to be done."""
    if setting == "system" or tcmalloc_loaded() or os.environ.get(REEXECUTED_ENV):
        return
    library = find_tcmalloc()
    if library is None:  # auto without the library
        return
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD", "")]))
    env = {**os.environ, "LD_PRELOAD": preload, REEXECUTED_ENV: "1"}
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def log_allocator() -> None:
    name = "tcmalloc" if tcmalloc_loaded() else "system malloc"
    log.info("allocator: %s (trainer.allocator)", name)
