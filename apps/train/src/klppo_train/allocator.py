"""The process's memory allocator (``trainer.allocator``): one that keeps freed memory.

Why: a PPO step allocates and frees gigabytes of activations, log-prob chunks and gradients.
glibc's malloc, as configured by default, hands blocks over 32 MiB back to the kernel on
free (``mmap``/``munmap``), and the heaps of the threads' own arenas (OpenMP workers) are
trimmed or unmapped, so every step page-faults its memory in again: a SmolLM2 critic update
read 650k minor faults and 6.4 s of system time in 8.7 s. Two remedies, both chosen before
the process starts, so the command line re-executes itself once with them:

- ``tcmalloc`` (``LD_PRELOAD``; vLLM-CPU recommends it): keeps freed memory for reuse.
  SmolLM2-135M bf16, 16 prompts × 4 × ≤ 64 tokens, steady steps 21.7 → 17.7 s (2-core Xeon).
- ``glibc-retain``: glibc's own malloc told to keep what it frees (``GLIBC_TUNABLES``: one
  arena, so worker threads allocate from the main heap; no ``mmap`` for large blocks; no
  trimming). Page faults then stop once the heap has grown to a step's peak (the first
  steps); same bench, steps 3-4: 21.4/24.9 → 19.4/21.4 s, update faults 200k → ~0.

``auto`` takes tcmalloc where the system has it, else ``glibc-retain`` on glibc;
``system`` leaves the C library's malloc as it is.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("klppo_train")

ALLOCATORS = ("auto", "tcmalloc", "glibc-retain", "system")
LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
REEXECUTED_ENV = "KLPPO_ALLOCATOR_REEXECUTED"
# Read by glibc (2.26+) when a process starts; 2**40: never trim.
RETAIN_TUNABLES = (
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    "glibc.malloc.trim_threshold=1099511627776",
)
_RETAIN_NAMES = {t.split("=")[0] for t in RETAIN_TUNABLES}


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library's name as the dynamic loader finds it, or None."""
    for name in LIBRARIES:
        if found := ctypes.util.find_library(name):
            return found
    return None


def tcmalloc_loaded() -> bool:
    maps = Path("/proc/self/maps")
    return maps.is_file() and "libtcmalloc" in maps.read_text()


def on_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # not a GNU C library (musl, macOS)
        return False


def glibc_retains() -> bool:
    """Whether this process started with :data:`RETAIN_TUNABLES`."""
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return on_glibc() and all(t in tunables for t in RETAIN_TUNABLES)


def check_allocator(setting: str) -> None:
    """Raise ``ValueError`` naming ``trainer.allocator`` when it cannot be honoured."""
    if setting not in ALLOCATORS:
        raise ValueError(f"trainer.allocator={setting!r}; valid: {', '.join(ALLOCATORS)}")
    if setting == "tcmalloc" and not (tcmalloc_loaded() or find_tcmalloc()):
        raise ValueError(
            "trainer.allocator=tcmalloc: no libtcmalloc on this system "
            "(Debian/Ubuntu: apt install libtcmalloc-minimal4), or use auto/system"
        )
    if setting == "glibc-retain" and not on_glibc():
        raise ValueError("trainer.allocator=glibc-retain: this C library is not glibc")


def allocator_env(setting: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with what ``setting`` needs from the start of a process: tcmalloc in
    ``LD_PRELOAD`` (``auto``, ``tcmalloc``, where it exists), else glibc's tunables (``auto``
    on glibc, ``glibc-retain``); ``env`` itself when nothing is to be added."""
    library = find_tcmalloc() if setting in ("auto", "tcmalloc") else None
    if library is not None:
        preload = env.get("LD_PRELOAD", "")
        if "tcmalloc" in preload:
            return env
        return {**env, "LD_PRELOAD": " ".join(filter(None, [library, preload]))}
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if setting == "system" or not on_glibc() or all(t in tunables for t in RETAIN_TUNABLES):
        return env
    kept = [t for t in tunables if t.split("=")[0] not in _RETAIN_NAMES]
    return {**env, "GLIBC_TUNABLES": ":".join([*kept, *RETAIN_TUNABLES])}


def without_allocator(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what :func:`allocator_env` adds (for a child that chooses its own)."""
    env = {k: v for k, v in env.items() if k != REEXECUTED_ENV}
    preload = [lib for lib in env.pop("LD_PRELOAD", "").split() if "tcmalloc" not in lib]
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t]
    tunables = [t for t in tunables if t not in RETAIN_TUNABLES]
    return {
        **env,
        **({"LD_PRELOAD": " ".join(preload)} if preload else {}),
        **({"GLIBC_TUNABLES": ":".join(tunables)} if tunables else {}),
    }


def reexec_with_allocator(setting: str) -> None:
    """Replace this process by the same command started with the allocator ``setting``
    asks for, when it is not running with it yet (once: a marker stops a second time).
    Returns only when nothing is to be done."""
    if setting == "system" or tcmalloc_loaded() or os.environ.get(REEXECUTED_ENV):
        return
    env = allocator_env(setting, dict(os.environ))
    if env == os.environ:
        return
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**env, REEXECUTED_ENV: "1"})


def allocator_name() -> str:
    if tcmalloc_loaded():
        return "tcmalloc"
    return "glibc malloc retaining freed memory" if glibc_retains() else "system malloc"


def log_allocator() -> None:
    log.info("allocator: %s (trainer.allocator)", allocator_name())
