"""The experiment trackers rank 0 reports to besides the console and ``metrics.jsonl``
(``trainer.logger``), each imported only when chosen:

- ``tensorboard``: event files under ``<run_dir>/tensorboard`` (torch's ``SummaryWriter``);
  generations as a text table.
- ``wandb``: a wandb run in project ``trainer.project_name`` named
  ``trainer.experiment_name``, its files under ``<run_dir>/wandb``; ``WANDB_MODE=offline``
  works without a network (``wandb sync`` uploads it later). Generations as a
  ``wandb.Table``.
- ``mlflow``: an MLflow run in experiment ``trainer.project_name``, in a SQLite store
  ``<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlartifacts`` (MLflow's local
  layout) unless ``MLFLOW_TRACKING_URI`` names a server or another store; the config as
  its parameters, generations as JSON artifacts.

Every tracker gets the same metric names (verl's) and values (global over ranks) at the same
step. A resumed run continues the same tracker run: wandb and MLflow by the run id kept in
``<run_dir>/trackers.json``; TensorBoard in the same directory, the events after the
checkpoint's step purged. (wandb ignores steps it has already seen: those of a crashed
segment stay as they were logged. MLflow keeps both values of such a step.)
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

IDS_FILE = "trackers.json"  # in the run directory: each tracker's run id
COLUMNS = (
    "step",
    "data_source",
    "prompt",
    "response",
    "ground_truth",
    "score",
    "reward_model_score",
)
"""A validation generation's fields (``trainer.log_val_generations``)."""


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told: where the run lives, its names, its config (nested, as
    ``--print-config`` shows it) and the step it starts after (0, or a checkpoint's)."""

    run_dir: Path
    project: str
    experiment: str
    config: dict[str, Any]
    start_step: int

    def previous_id(self, backend: str) -> str | None:
        """The backend's run id to continue: a resumed run's, else None."""
        path = self.run_dir / IDS_FILE
        if not self.start_step or not path.is_file():
            return None
        return json.loads(path.read_text()).get(backend)

    def keep_id(self, backend: str, run_id: str) -> None:
        path = self.run_dir / IDS_FILE
        ids = json.loads(path.read_text()) if path.is_file() else {}
        ids[backend] = run_id
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(ids, indent=2))
        os.replace(tmp, path)


class TensorBoard:
    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run replaces what a crashed segment logged after its checkpoint
        purge = run.start_step + 1 if run.start_step else None
        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("val/generations", _markdown(rows), step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, run: TrackedRun):
        import wandb

        self.wandb = wandb
        run_id = run.previous_id("wandb") or uuid.uuid4().hex[:8]  # wandb: [a-z0-9]
        run.keep_id("wandb", run_id)
        self.run = wandb.init(
            project=run.project,
            name=run.experiment,
            id=run_id,
            resume="allow",
            dir=str(run.run_dir),
            config=run.config,
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(
            columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows]
        )
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, run: TrackedRun):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        # MLflow's own local layout (what `mlflow ui` opens): a SQLite store and an artifact
        # folder, here in the run directory. (Its ./mlruns file store is deprecated.)
        local = run.run_dir.resolve()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{local / 'mlflow.db'}")
        self.run_id = run.previous_id("mlflow")
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(run.project)
        artifacts = None if uri else (local / "mlartifacts").as_uri()
        experiment = (
            found.experiment_id if found else self.client.create_experiment(run.project, artifacts)
        )
        self.run_id = self.client.create_run(experiment, run_name=run.experiment).info.run_id
        run.keep_id("mlflow", self.run_id)
        self._log_params(_flat(run.config))

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        name = f"val_generations/step_{step:06d}.json"
        self.client.log_dict(self.run_id, {"columns": list(COLUMNS), "rows": rows}, name)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def open_trackers(loggers: tuple[str, ...], run: TrackedRun) -> list[Tracker]:
    """The chosen trackers (``console`` and ``file`` are the metrics log's own), opened."""
    return [TRACKERS[name](run) for name in loggers if name in TRACKERS]


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


def _markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table (TensorBoard renders it), one row per generation."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
