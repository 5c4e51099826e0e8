"""Rank 0's record of a run: ``metrics.jsonl`` (``file``), the progress bar (``console``),
``val_generations.jsonl`` and the chosen trackers (:mod:`klppo_train.tracking.trackers`).

``metrics.jsonl`` holds one JSON object per step (``step`` plus verl's metric names; step 0
is the validation before any update); a resumed run drops the lines after its checkpoint's
step and appends from there, so the file always reads as one run (``val_generations.jsonl``
likewise).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klppo_train.config.errors import UserError
from klppo_train.tracking.trackers import TrackedRun, open_trackers

log = logging.getLogger("klppo_train")

GENERATIONS_FILE = "val_generations.jsonl"  # in the run directory
# The progress bar's fields: label → metric.
SHOWN = {"score": "critic/score/mean"}
ACCURACIES = ("/acc", "/accuracy")  # a rule's, a reward model's pairwise


@dataclass(frozen=True)
class Tracking:
    """Where a run's metrics go (``trainer.logger``), under which names
    (``trainer.project_name`` / ``experiment_name``; "" = the run directory's name), how many
    validation generations each validation step records (``trainer.log_val_generations``)
    and the resolved config the trackers store (nested, as ``--print-config`` shows it)."""

    loggers: tuple[str, ...]
    project: str
    experiment: str
    generations: int
    config: dict[str, Any]

    @classmethod
    def of(cls, trainer: Any, config: dict[str, Any]) -> Tracking:
        """From the ``trainer`` section and the whole config as a dict (what trackers store)."""
        t = trainer
        name = t.experiment_name or Path(t.run_dir).expanduser().resolve().name
        return cls(tuple(t.logger), t.project_name, name, t.log_val_generations, config)


def read_jsonl(path: Path, up_to_step: int | None = None) -> list[dict]:
    """The records of ``path`` (none if it is missing) up to ``up_to_step``.

    A last line that is not JSON is what a crash in the middle of an append leaves: it is
    dropped with one warning (a resumed run rewrites the file without it). Any other line
    that is not JSON is damage this cannot mend: a :class:`UserError` naming the file and line.
    """
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if n != lines[-1][0]:
                msg = f"{path}: line {n} is not JSON ({err.msg}); the file is damaged"
                raise UserError(msg) from err
            log.warning("%s: dropped a partial last line %d (%d chars: a crash while it was "
                        "written)", path, n, len(line))  # fmt: skip
    return [r for r in records if up_to_step is None or r["step"] <= up_to_step]


def _sync(path: Path) -> None:
    """``path``'s appended lines on the disk itself (a checkpoint counts only after this)."""
    if path.exists():
        with path.open("rb") as f:
            os.fsync(f.fileno())


def _rewrite(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


class MetricsLog:
    """Rank 0's sink for step metrics and validation generations (``enabled`` false on the
    other ranks: they only keep the records)."""

    def __init__(
        self,
        run_dir: Path,
        start_step: int,
        total_steps: int,
        tracking: Tracking,
        enabled: bool = True,
        desc: str = "PPO",
        shown: dict[str, str] = SHOWN,
    ):
        self.path = run_dir / "metrics.jsonl"
        self.generations_path = run_dir / GENERATIONS_FILE
        self.enabled, self.shown, self.tracking = enabled, shown, tracking
        self.records = read_jsonl(self.path, up_to_step=start_step) if start_step else []
        self.generations = read_jsonl(self.generations_path, start_step) if start_step else []
        validated = [r for r in self.records if any(k.startswith("val/") for k in r)]
        self.last_val = _mean_acc(validated[-1]) if validated else None
        self.file = enabled and "file" in tracking.loggers
        self.trackers = []
        if not enabled:
            return
        if self.file:
            _rewrite(self.path, self.records)
        if tracking.generations:
            _rewrite(self.generations_path, self.generations)
        t = tracking
        run = TrackedRun(run_dir, t.project, t.experiment, t.config, start_step)
        self.trackers = open_trackers(tracking.loggers, run)
        self.bar = None
        if "console" in tracking.loggers:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        if not self.enabled:
            return
        if self.file:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)
        if step > 0 and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(self._postfix(), refresh=False)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A validation step's generations (:data:`klppo_train.tracking.trackers.COLUMNS`)."""
        rows = [{"step": step, **r} for r in rows]
        self.generations += rows
        if not self.enabled or not rows:
            return
        with self.generations_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for tracker in self.trackers:
            tracker.log_generations(step, rows)

    def sync(self) -> None:
        """The files' lines so far on the disk (before a checkpoint is published: a crash
        after it then finds every step it holds in ``metrics.jsonl``)."""
        if self.enabled:
            _sync(self.path)
            _sync(self.generations_path)

    def _postfix(self) -> dict[str, str]:
        last = self.records[-1]
        if any(k.startswith("val/") for k in last):
            self.last_val = _mean_acc(last)
        shown = {label: f"{last.get(key, float('nan')):.2f}" for label, key in self.shown.items()}
        # The KL to the reference where the run has one: in the reward, else in the loss.
        for name in ("actor/reward_kl_penalty", "actor/kl_loss"):
            if name in last:
                shown["kl"] = f"{last[name]:.3f}"
                break
        if self.last_val is not None:
            shown["val"] = f"{self.last_val:.2f}"
        return shown

    def close(self) -> None:
        if self.enabled and self.bar is not None:
            self.bar.close()
        for tracker in self.trackers:
            tracker.close()


def _mean_acc(record: dict) -> float:
    accs = [v for k, v in record.items() if k.startswith("val/") and k.endswith(ACCURACIES)]
    return sum(accs) / len(accs) if accs else float("nan")
