"""The names ``trainer.logger`` accepts and the optional extra each needs, checked without
importing any of them (a missing tracker is a config error, before torch loads)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """A ``trainer.logger`` name: the module it imports (None: built in) and the extra of
    klppo-train that installs it."""

    name: str
    module: str | None = None
    extra: str | None = None


BACKENDS = {
    b.name: b
    for b in (
        Backend("console"),  # the progress bar and the end-of-run summary
        Backend("file"),  # metrics.jsonl in the run directory
        Backend("tensorboard", "tensorboard", "tensorboard"),
        Backend("wandb", "wandb", "wandb"),
        Backend("mlflow", "mlflow", "mlflow"),
    )
}


def check_loggers(names: tuple[str, ...]) -> None:
    """ValueError naming the first unknown or not-installed backend (and its extra)."""
    for name in names:
        if name not in BACKENDS:
            raise ValueError(
                f"trainer.logger: {name!r} is not a logger; valid: {', '.join(BACKENDS)}"
            )
        backend = BACKENDS[name]
        if backend.module and importlib.util.find_spec(backend.module) is None:
            raise ValueError(
                f"trainer.logger: {name} is not installed; install the extra: "
                f"pip install 'klppo-train[{backend.extra}]' (or uv sync --extra {backend.extra})"
            )
