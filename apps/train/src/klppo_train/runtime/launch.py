"""What the launcher set up, known before the process group exists, and deferred imports: both
torch-free, so the checks before any model loads answer in about a second."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable


def launch_world_size() -> int:
    """The world size the launcher set up (torchrun's ``WORLD_SIZE``; 1 without it), known
    before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def deferred(target: str) -> Callable:
    """``"module:function"`` as a function that imports its module when called: what loads
    torch, transformers or vLLM is imported after the checks, so a config or data error
    answers in about a second."""

    def call(*args, **kwargs):
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = target
    return call
