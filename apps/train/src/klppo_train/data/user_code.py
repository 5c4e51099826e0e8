"""A user's Python file run as a module: a custom reward's (``reward.custom``), a tool's
(``rollout.multi_turn.tool_config_path``). Their code runs in the trainer's process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_user_file(path: Path, prefix: str) -> ModuleType:
    """``path`` executed as a module named ``<prefix>_<hash of the path>``, registered in
    ``sys.modules`` before it runs so that dataclasses and pickle inside it find it."""
    name = f"{prefix}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
