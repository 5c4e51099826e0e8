"""What a run shows and leaves behind: progress bar, metrics.jsonl, TensorBoard, plot, summary.

Only rank 0 reports. ``metrics.jsonl`` holds one JSON object per step (``step`` plus verl's
metric names; step 0 is the validation before any update); a resumed run drops the lines
after its checkpoint's step and appends from there, so the file always reads as one run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("klppo_train")

PLOTTED = (
    ("critic/score/mean", "score"),
    ("val/*/acc", "validation accuracy"),
    ("actor/reward_kl_penalty", "KL(policy ‖ ref)"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "response length"),
)
# A reward-model run (trainer.task=reward_model): its loss and pairwise accuracy.
PLOTTED_RM = (("rm/loss", "pairwise loss"), ("*rm/accuracy", "pairwise accuracy (train, val)"))
# The progress bar's fields: label → metric.
SHOWN = {"score": "critic/score/mean"}
SHOWN_RM = {"loss": "rm/loss", "acc": "rm/accuracy"}


def read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if up_to_step is None or r["step"] <= up_to_step]


class MetricsLog:
    """Rank 0's sink for step metrics: JSONL, TensorBoard (if installed), a progress bar."""

    def __init__(
        self,
        run_dir: Path,
        start_step: int,
        total_steps: int,
        enabled: bool = True,
        desc: str = "PPO",
        shown: dict[str, str] = SHOWN,
    ):
        self.path = run_dir / "metrics.jsonl"
        self.enabled, self.shown = enabled, shown
        self.records = read_metrics(self.path, up_to_step=start_step) if start_step else []
        validated = [r for r in self.records if any(k.startswith("val/") for k in r)]
        self.last_val = _mean_acc(validated[-1]) if validated else None
        if not enabled:
            return
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        self.tensorboard = _tensorboard_writer(run_dir / "tensorboard")
        self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(name, value, step)
        if step > 0:
            self.bar.update(1)
            self.bar.set_postfix(self._postfix(), refresh=False)

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
        if self.enabled:
            self.bar.close()
            if self.tensorboard is not None:
                self.tensorboard.close()


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the optional `tensorboard` extra is not installed
        return None
    return SummaryWriter(str(log_dir))


def _mean_acc(record: dict) -> float:
    accs = [v for k, v in record.items() if k.startswith("val/") and k.endswith(ACCURACIES)]
    return sum(accs) / len(accs) if accs else float("nan")


ACCURACIES = ("/acc", "/accuracy")  # a rule's, a reward model's pairwise


def _series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    prefix, _, suffix = pattern.partition("*")
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        for key, value in r.items():
            if key == pattern or (
                "*" in pattern and key.startswith(prefix) and key.endswith(suffix)
            ):
                steps, values = out.setdefault(key, ([], []))
                steps.append(r["step"])
                values.append(value)
    return out


def plot_metrics(records: list[dict], path: Path, panels=PLOTTED) -> Path:
    """One PNG with a panel per plotted metric (``panels``: (pattern, title)) against the
    step; written atomically."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (pattern, title) in zip(axes, panels, strict=True):
        for key, (steps, values) in _series(records, pattern).items():
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if "*" in pattern and ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def summarize(records: list[dict], minutes: float, run_dir: Path, plot: Path) -> dict:
    """Baseline (step 0) and final validation accuracy per source, the best, time, paths."""
    val = [r for r in records if any(k.startswith("val/") for k in r)]
    summary: dict = {"steps": records[-1]["step"] if records else 0, "minutes": round(minutes, 2)}
    if val:
        for key in sorted({k for r in val for k in r if k.startswith("val/")}):
            seen = [r[key] for r in val if key in r]
            summary[f"baseline_{key}"] = seen[0]
            summary[f"final_{key}"] = seen[-1]
            summary[f"best_{key}"] = max(seen)
    kls = [r["actor/reward_kl_penalty"] for r in records if "actor/reward_kl_penalty" in r]
    if kls:
        summary["max_kl"] = max(kls)
    summary.update(run_dir=str(run_dir), plot=str(plot), metrics=str(run_dir / "metrics.jsonl"))
    return summary


def summary_text(summary: dict) -> str:
    """The one-screen end-of-run report."""
    lines = [f"klppo run finished: {summary['steps']} steps in {summary['minutes']:.1f} min"]
    for key in sorted(k for k in summary if k.startswith("baseline_")):
        name = key.removeprefix("baseline_")
        lines.append(
            f"  {name}: {summary[key]:.3f} → {summary['final_' + name]:.3f} "
            f"(best {summary['best_' + name]:.3f})"
        )
    if "max_kl" in summary:
        lines.append(f"  max KL(policy ‖ ref) per step: {summary['max_kl']:.3f}")
    lines += [f"  {k}: {summary[k]}" for k in ("run_dir", "metrics", "plot")]
    return "\n".join(lines)
