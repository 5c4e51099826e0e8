"""What a run leaves behind at its end: the plot and the summary (rank 0). The per-step
record is :mod:`klppo_train.tracking.metrics_log`'s."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

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
# The progress bar's fields of a reward-model run: label → metric.
SHOWN_RM = {"loss": "rm/loss", "acc": "rm/accuracy"}


def metric_series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` of every metric ``key`` matching ``pattern`` (a name, or
    one with a single ``*``)."""
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
    return plot_runs({"": records}, path, panels)


def group_means(runs: dict[str, list[dict]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per group of runs (:func:`run_group`: "tis/s1" and "tis/s2" are one group), the
    mean of metric ``key`` over the group's runs, at the steps where every one of them
    recorded it: ``{group: (steps, means)}``, without groups that have no such step."""
    members: dict[str, list[dict[int, float]]] = {}
    for label, records in runs.items():
        seen = {r["step"]: r[key] for r in records if key in r}
        members.setdefault(run_group(label), []).append(seen)
    out = {}
    for group, seen in members.items():
        steps = sorted(set.intersection(*(set(s) for s in seen)))
        if steps:  # a group that never recorded the metric draws no line
            out[group] = (steps, [sum(s[t] for s in seen) / len(seen) for t in steps])
    return out


def plot_runs(
    runs: dict[str, list[dict]], path: Path, panels=PLOTTED, xlabel: str = "step"
) -> Path:
    """:func:`plot_metrics` for several runs (``{label: records}``): each run a thin line in
    its group's colour (groups as :func:`group_means`), each group's mean a thick one, so
    seeds of a setting read as a band around its mean. One run: its series as they are.
    ``xlabel``: what the records' ``step`` holds (another x: the group means are then drawn
    only where the runs share an x)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(run_group(label) for label in runs))
    colour = {group: f"C{i}" for i, group in enumerate(groups)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (pattern, title) in zip(axes[0], panels, strict=True):
        if len(runs) == 1:
            _plot_series(ax, metric_series(next(iter(runs.values())), pattern))
        else:
            _plot_groups(ax, runs, pattern, colour)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ("*" in pattern or len(runs) > 1) and ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def run_group(label: str) -> str:
    """A run label's group: its text before the first "/" ("tis/s1" → "tis")."""
    return label.split("/", 1)[0]


def _marker(steps: list[int]) -> str | None:
    return "." if len(steps) < 60 else None  # points only where they stay readable


def _plot_series(ax, series: dict[str, tuple[list[int], list[float]]]) -> None:
    for key, (steps, values) in series.items():
        ax.plot(steps, values, marker=_marker(steps), label=key)


def _plot_groups(ax, runs: dict[str, list[dict]], pattern: str, colour: dict) -> None:
    keys: dict[str, None] = {}
    for label, records in runs.items():
        for key, (steps, values) in metric_series(records, pattern).items():
            keys[key] = None
            ax.plot(steps, values, color=colour[run_group(label)], lw=0.8, alpha=0.5, marker=".")
    sizes = Counter(run_group(label) for label in runs)
    for key in keys:
        for group, (steps, means) in group_means(runs, key).items():
            name = group if len(keys) == 1 else f"{group} {key}"
            label = f"{name} (mean of {sizes[group]})" if sizes[group] > 1 else name
            ax.plot(steps, means, color=colour[group], lw=2, marker=_marker(steps), label=label)


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


def summary_text(summary: dict, generation: dict | None = None) -> str:
    """The one-screen end-of-run report; with ``generation`` (the last validation step's
    first, ``trainer.log_val_generations``) what the policy wrote."""
    validated = "validated" in summary  # trainer.val_only: one validation
    lines = [
        f"klppo validated {summary['validated']} in {summary['minutes']:.1f} min"
        if validated
        else f"klppo run finished: {summary['steps']} steps in {summary['minutes']:.1f} min"
    ]
    for key in sorted(k for k in summary if k.startswith("baseline_")):
        name = key.removeprefix("baseline_")
        final = summary["final_" + name]
        lines.append(
            f"  {name}: {final:.3f}"
            if validated
            else f"  {name}: {summary[key]:.3f} → {final:.3f} (best {summary['best_' + name]:.3f})"
        )
    if "max_kl" in summary:
        lines.append(f"  max KL(policy ‖ ref) per step: {summary['max_kl']:.3f}")
    best = summary.get("best")
    if best and best["export"]:
        lines.append(
            f"  best {best['metric']}: {best['value']:.3f} at step {best['step']}: "
            f"{Path(summary['run_dir']) / best['export']}"
        )
    lines += [f"  {k}: {summary[k]}" for k in ("run_dir", "metrics", "plot")]
    if generation is not None:
        lines.append(f"  a validation sample (step {generation['step']}):")
        for field in ("prompt", "response", "ground_truth", "score"):
            lines.append(f"    {field}: {generation[field]!r}")
    return "\n".join(lines)
