"""The process's memory allocator (``trainer.allocator``): one that keeps freed memory.

Why: a PPO step allocates and frees gigabytes of activations, log-prob chunks and gradients.
glibc's malloc, as configured by default, hands blocks over 32 MiB back to the kernel on
free (``mmap``/``munmap``), and the heaps of the threads' own arenas (OpenMP workers) are
trimmed or unmapped, so every step page-faults its memory in again: a SmolLM2 critic update
read 650k minor faults and 6.4 s of system time in 8.7 s. Two remedies:

- ``tcmalloc`` (vLLM-CPU recommends it): keeps freed memory for reuse. It can only be
  chosen when a process starts (``LD_PRELOAD``), so the command line re-executes itself
  once with it (start-up paid twice: ~15 s on 2 cores). SmolLM2-135M bf16, 16 prompts × 4 ×
  ≤ 64 tokens, steady steps 21.7 → 17.7 s (2-core Xeon).
- ``glibc-retain``: glibc's own malloc told, through ``mallopt`` right after the config is
  read (before any thread allocates), to keep what it frees: one arena, so worker threads
  allocate from the main heap; no ``mmap`` for large blocks; no trimming below 2 GiB. Page
  faults then stop once the heap has grown to a step's peak (the first steps); same
  setting, steps 3-4: 21.4/24.9 → 19.4/21.4 s, update faults 28k-200k → ~0. Children that
  must start with it get the same as ``GLIBC_TUNABLES`` (:func:`allocator_env`).

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
# glibc-retain, once: (tunable, mallopt option, value). One arena; no mmap for large blocks;
# trim only above 2 GiB free (mallopt takes an int: 2**31 - 1 is its largest).
_RETAIN = (("arena_max", -8, 1), ("mmap_max", -4, 0), ("trim_threshold", -1, 2**31 - 1))
# The same as glibc (2.26+) reads them when a process starts.
RETAIN_TUNABLES = tuple(f"glibc.malloc.{name}={value}" for name, _, value in _RETAIN)
_RETAIN_NAMES = {t.split("=")[0] for t in RETAIN_TUNABLES}
_retaining = False  # retain_freed_memory() took effect in this process


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
    """Whether this process started with :data:`RETAIN_TUNABLES` (a child given
    :func:`allocator_env`, e.g. the TRL benchmark's worker)."""
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


def retain_freed_memory() -> bool:
    """Tell this process's glibc malloc to keep what it frees (:data:`RETAIN_TUNABLES` through
    ``mallopt``). Must run before worker threads first allocate (they would keep arenas of
    their own): the trainer calls it right after reading its config, before any model,
    engine or thread pool exists. True when glibc took all three."""
    if not on_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    taken = [mallopt(option, value) for _, option, value in _RETAIN]
    global _retaining
    _retaining = all(taken)
    return _retaining


def use_allocator(setting: str) -> None:
    """Make this process run with the allocator ``setting`` asks for: glibc's tunables set
    in place (``glibc-retain``, ``auto`` without tcmalloc), or tcmalloc by replacing the
    process with the same command started with it preloaded (once: a marker stops a second
    time). Returns unless it re-executes."""
    if setting == "system" or tcmalloc_loaded():
        return
    if setting in ("auto", "tcmalloc") and find_tcmalloc() and not os.environ.get(REEXECUTED_ENV):
        env = allocator_env(setting, dict(os.environ))  # with tcmalloc in LD_PRELOAD
        sys.stdout.flush(), sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, {**env, REEXECUTED_ENV: "1"})
    if setting in ("auto", "glibc-retain"):
        retain_freed_memory()


def allocator_name() -> str:
    if tcmalloc_loaded():
        return "tcmalloc"
    retaining = _retaining or glibc_retains()
    return "glibc malloc retaining freed memory" if retaining else "system malloc"


def log_allocator() -> None:
    log.info("allocator: %s (trainer.allocator)", allocator_name())
