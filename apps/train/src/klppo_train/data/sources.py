"""What a recipe can ask the run to prepare when it is missing: a model (``model.source``),
a data set (``data.source``), and the embedded default (empty ``model.path``: a built-in
tiny model, its tokenizer and its task).

Core code reads this registry and never imports the demos; :mod:`klppo_train.demo` fills it
(:func:`klppo_train.demo.sources.register_sources`, which the command line calls), so the demo room
stays a leaf. What is prepared is written only under ``<trainer.run_dir>/`` for data (a
mistyped path elsewhere stays an error, not generated data) or at ``model.path`` for a
model, atomically, and under a file lock, so concurrent ranks prepare once.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klppo_train.data.datasets import check_row, write_parquet
from klppo_train.data.pairs import check_pair_row

log = logging.getLogger("klppo_train")

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Embedded:
    """The embedded default: its tokenizer, its task's files (name → rows) and a function
    that builds, warms up and saves its model: ``model(path, *, train_rows, warmup_steps,
    target_accuracy, seed) -> path``."""

    tokenizer: Callable[[], Any]
    data: dict[str, Callable[[], Rows]]
    model: Callable[..., Path]


MODEL_SOURCES: dict[str, Callable[[Path], Any]] = {}
"""``model.source`` name → ``convert(path)`` writing a HF directory at ``path``."""
DATA_SOURCES: dict[str, Callable[[], tuple[Rows, Rows]]] = {}
"""``data.source`` name → ``() -> (train rows, val rows)``."""
PREFERENCE_SOURCES: dict[str, Callable[[Path], tuple[Rows, Rows]]] = {}
"""``data.source`` name → ``(model_path) -> (train pairs, val pairs)``: preference pairs made
with the recipe's model (``trainer.task=reward_model``)."""
_embedded: list[Embedded] = []


def register(
    models: dict[str, Callable[[Path], Any]],
    data: dict[str, Callable[[], tuple[Rows, Rows]]],
    embedded: Embedded,
    preferences: dict[str, Callable[[Path], tuple[Rows, Rows]]] | None = None,
) -> None:
    """Make these sources (and the embedded default) available to recipes."""
    MODEL_SOURCES.update(models)
    DATA_SOURCES.update(data)
    PREFERENCE_SOURCES.update(preferences or {})
    _embedded[:] = [embedded]


def embedded() -> Embedded:
    """The registered embedded default; ValueError when none is (``model.path`` is empty)."""
    if not _embedded:
        raise ValueError(
            "model.path is empty and no embedded default model is registered "
            "(klppo_train.demo.sources.register_sources())"
        )
    return _embedded[0]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare_model(source: str, path: Path) -> None:
    """Build ``path`` from ``source`` (``model.source``) when it has no model yet."""
    if not source or (path / "config.json").is_file():
        return
    with _locked(path):
        if not (path / "config.json").is_file():
            log.info("model.source=%s: writing %s (once)", source, path)
            MODEL_SOURCES[source](path)


def prepare_data(
    source: str, files: list[Path], data_dir: Path, embedded_data: bool, model_path: Path
) -> None:
    """Write the missing ``files`` under ``data_dir`` (``<trainer.run_dir>/data``) that
    ``source`` (``data.source``; a preference source samples ``model_path``), or with
    ``embedded_data`` the embedded default, provides (``train.parquet``, ``val.parquet``)."""
    writers: dict[str, Callable[[], Rows]] = {}
    check = check_row
    missing = [p for p in files if not p.exists()]
    if source in PREFERENCE_SOURCES and missing:
        train, val = PREFERENCE_SOURCES[source](model_path)
        writers = {"train.parquet": lambda: train, "val.parquet": lambda: val}
        check = check_pair_row
    elif source in DATA_SOURCES:
        train, val = DATA_SOURCES[source]()
        writers = {"train.parquet": lambda: train, "val.parquet": lambda: val}
    elif embedded_data:
        writers = embedded().data
    data_dir = data_dir.resolve()
    for path in files:
        if path.exists() or path.resolve().parent != data_dir or path.name not in writers:
            continue
        with _locked(path):
            if not path.exists():
                rows = writers[path.name]()
                write_parquet(rows, path, check)
                log.info("wrote %d rows to %s", len(rows), path)
