"""Overlay several runs' metrics in one PNG: the seeds of a setting as thin lines around their
mean, one colour per setting (how docs/img's comparison plots are made).

    python scripts/plot_runs.py --out docs/img/x.png tis/s1=runs/a tis/s2=runs/b \\
        plain/s1=runs/c plain/s2=runs/d [--panel 'val/*/acc=held-out accuracy' ...]

A label's text before "/" names its group (``tis``, ``plain``). Without ``--panel`` the panels
are the end-of-run plot's. ``--x-sqrt-kl`` draws them against √KL instead of the step, as Gao et
al. (2022) plot gold and proxy reward: KL = the step's per-token KL to the reference
(``actor/reward_kl_penalty``) × its mean response length, in nats per response; only steps
that record both (and the panel's metric) are drawn. Prints each run's last value of every
plotted metric and each group's mean of them. A run directory without ``metrics.jsonl`` exits 2
with one line.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from klppo_train.loop.report import PLOTTED, metric_series, plot_runs, run_group
from klppo_train.tracking.metrics_log import read_jsonl


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="GROUP/NAME=RUN_DIR")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument(
        "--panel",
        action="append",
        default=[],
        metavar="PATTERN=TITLE",
        help="a metric (or a pattern with one *) and its panel's title; repeatable",
    )
    parser.add_argument(
        "--x-sqrt-kl", action="store_true", help="x = √(KL per response) instead of the step"
    )
    return parser.parse_args()


def against_sqrt_kl(records: list[dict]) -> list[dict]:
    """The records that carry the KL and the response length, each with its ``step``
    replaced by √(per-token KL × mean response length)."""
    kl, length = "actor/reward_kl_penalty", "response_length/mean"
    return [
        {**r, "step": math.sqrt(max(r[kl], 0.0) * r[length])}
        for r in records
        if kl in r and length in r
    ]


def last_values(runs: dict[str, list[dict]], patterns: list[str]) -> list[str]:
    """Lines: every run's last value of each metric the patterns match, then each group's
    mean of those last values."""
    lines, by_group = [], {}
    for label, records in runs.items():
        for pattern in patterns:
            for key, (steps, values) in metric_series(records, pattern).items():
                lines.append(f"{label:<16} {key:<40} step {steps[-1]:>4}  {values[-1]:.4f}")
                by_group.setdefault((run_group(label), key), []).append(values[-1])
    for (group, key), finals in by_group.items():
        mean = sum(finals) / len(finals)
        lines.append(f"{group + ' mean':<16} {key:<40} ({len(finals)} runs)  {mean:.4f}")
    return lines


def main() -> int:
    args = _parse()
    runs = {}
    for spec in args.runs:
        label, sep, run_dir = spec.partition("=")
        path = Path(run_dir) / "metrics.jsonl"
        if not sep or not path.is_file():
            print(
                f"plot_runs: {spec!r}: want LABEL=RUN_DIR with RUN_DIR/metrics.jsonl",
                file=sys.stderr,
            )
            return 2
        runs[label] = read_jsonl(path)
    panels = [tuple(p.split("=", 1)) if "=" in p else (p, p) for p in args.panel] or PLOTTED
    if args.x_sqrt_kl:
        runs = {label: against_sqrt_kl(records) for label, records in runs.items()}
    xlabel = "√KL(policy ‖ ref) per response, nats^½" if args.x_sqrt_kl else "step"
    plot_runs(runs, args.out, panels, xlabel=xlabel)
    print("\n".join(last_values(runs, [pattern for pattern, _ in panels])))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
