"""``python field_usage_runner.py OUT.json [klppo-train args]``: run the trainer and record
which config fields its code reads (``Class.field``), for ``test_field_usage``.

Counted: reads from the trainer's own modules and, for the packages' configs the app's
sections hold (``ShardingConfig``, ``SamplingConfig``, ...), from that package's modules --
except the app's config module and every validation check (a key that is only ever checked
does nothing). Not counted: reads by dataclasses/OmegaConf machinery (copies, ``replace``,
YAML dumps), which touch every field.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import klppo_train
from klppo_train.__main__ import main
from klppo_train.config.schema import AppConfig, section_type

APP = Path(klppo_train.__file__).resolve().parent
APP_CONFIG = APP / "config" / "schema.py"
CHECKS = {"validate_config", "_positive_counts", "_get", "__post_init__"}


def config_classes() -> list[type]:
    """AppConfig and every dataclass its sections hold, however deep."""
    found, stack = [], [AppConfig]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack += [t for f in fields(cls) if (t := section_type(cls, f.name)) is not None]
    return found


def _home(cls: type) -> Path:
    """The directory whose code consumes ``cls``: the app's, or the package's that owns it."""
    module = sys.modules[cls.__module__]
    return Path(module.__file__).resolve().parent


def _is_check(name: str) -> bool:
    return name in CHECKS or name.startswith("_check")


def track(reads: set[str]) -> None:
    for cls in config_classes():
        names = {f.name for f in fields(cls)}
        homes = {APP, *(_home(c) for c in cls.__mro__ if is_dataclass(c))}

        def getattribute(self, name, _names=names, _cls=cls, _homes=homes):
            if name in _names:
                code = sys._getframe(1).f_code
                path = Path(code.co_filename).resolve()
                consumer = any(path.is_relative_to(h) for h in _homes) and path != APP_CONFIG
                if consumer and not _is_check(code.co_name):
                    reads.add(f"{_cls.__name__}.{name}")
            return object.__getattribute__(self, name)

        cls.__getattribute__ = getattribute


if __name__ == "__main__":
    out, args = Path(sys.argv[1]), sys.argv[2:]
    seen: set[str] = set()
    track(seen)
    sys.argv = [sys.argv[0], *args]  # main() as the command line (it may re-execute this)
    try:
        code = main()
    finally:
        out.write_text(json.dumps(sorted(seen)))
    sys.exit(code)
