"""``python field_usage_runner.py OUT.json [klppo-train args]``: run the trainer and record
which config fields its code reads (``Class.field``), for ``test_field_usage``.

Counted: reads from the trainer's own modules, except the config module itself and the
validation checks (a key that is only ever checked does nothing). Not counted: reads by
dataclasses/OmegaConf machinery (copies, YAML dumps), which touch every field.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import klppo_train
from klppo_train import validate
from klppo_train.__main__ import main
from klppo_train.config import AppConfig

PACKAGE = Path(klppo_train.__file__).resolve().parent
CHECKS = {name for name in vars(validate) if name.startswith("_check")} | {
    "validate_config",
    "_positive_counts",
    "_get",
    "__post_init__",
    "_check_int",
}


def config_classes() -> list[type]:
    found, stack = [], [AppConfig]
    while stack:
        cls = stack.pop()
        found.append(cls)
        factories = (f.default_factory for f in fields(cls))
        stack += [f for f in factories if f is not MISSING and is_dataclass(f)]
    return found


def track(reads: set[str]) -> None:
    for cls in config_classes():
        names = {f.name for f in fields(cls)}

        def getattribute(self, name, _names=names, _cls=cls):
            if name in _names:
                code = sys._getframe(1).f_code
                path = Path(code.co_filename).resolve()
                ours = path.is_relative_to(PACKAGE) and path.name != "config.py"
                if ours and code.co_name not in CHECKS:
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
