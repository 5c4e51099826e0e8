"""A generating rank of its own against the synchronous run: how much of generation and
training overlap (``async_training.rollout_ranks``).

    uv run --no-sync python benchmarks/async_bench.py [--steps 12] [--recipe R.yaml]
        [--variants sync,dp2,split0,split1] [key=value ...]

Runs the recipe (default: the embedded default) ``--steps`` steps per variant, one after the
other, on the same model and data files (the first variant prepares them):

- ``sync``: one process, every step generates then trains (all the machine's threads);
- ``dp2``: two data-parallel ranks under torchrun, each generating and training half;
- ``splitS``: torchrun, one training and one generating rank, each batch generated S steps
  ahead (S = 0: the synchronous algorithm, the ranks take turns; S ≥ 1: they overlap).

Per variant, over the steps after the first (its start-up: engine warm-up, compilation):
the mean step time (``timing_s/step``, the training rank's whole step, waiting included),
the generation and update times, the weight sync, and for the split the training rank's
idle time (``async/trainer_idle_s``: waiting for a batch) and the generating rank's
(``async/generator_idle_s``: waiting for weights). The overlap's ceiling: a step can take no
less than the slower side, max(generation, the rest of the step).

Prints a markdown table and writes ``benchmarks/results/async_bench.json`` (atomically).
Numbers on a shared 2-core VM move by ±30 %; compare the variants of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import RESULTS_DIR, write_results

RESULTS = RESULTS_DIR / "async_bench.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
MEANS = {
    "step_s": "timing_s/step",
    "gen_s": "timing_s/gen",
    "update_actor_s": "timing_s/update_actor",
    "update_weights_s": "timing_s/update_weights",
    "trainer_idle_s": "async/trainer_idle_s",
    "generator_idle_s": "async/generator_idle_s",
}


def variant_args(name: str) -> tuple[list[str], list[str]]:
    """(launcher, overrides) of a variant."""
    if name == "sync":
        return [sys.executable], []
    if name == "dp2":
        return TORCHRUN, []
    lag = int(name.removeprefix("split"))
    ahead = ["async_training.enable=true", "async_training.rollout_ranks=1"]
    return TORCHRUN, [*ahead, f"async_training.max_staleness_steps={lag}"]


def run_variant(name: str, root: Path, first: Path, args: argparse.Namespace) -> dict:
    launcher, more = variant_args(name)
    run = root / name
    shared = [] if run == first else [
        f"model.path={first / 'model'}",
        f"data.train_files=[{first / 'data/train.parquet'}]",
        f"data.val_files=[{first / 'data/val.parquet'}]",
    ]  # fmt: skip
    cmd = [
        *launcher, "-m", "klppo_train", *([args.recipe] if args.recipe else []),
        f"trainer.run_dir={run}", f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false",
        *shared, *more, *args.overrides,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 2]  # the first step starts everything up
    found = {"variant": name, "steps": len(steps)}
    for key, metric in MEANS.items():
        values = [r[metric] for r in steps if metric in r]
        found[key] = statistics.mean(values) if values else None
    return found


def table(rows: list[dict]) -> str:
    names = ("step", "gen", "actor update", "weight sync", "trainer idle", "generator idle")
    lines = [
        "| variant | " + " | ".join(f"{n} s" for n in names) + " | vs sync |",
        "|---" * 8 + "|",
    ]
    base = rows[0]["step_s"]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        cells = [r[k] for k in MEANS]
        lines.append(
            f"| {r['variant']} | "
            + " | ".join(fmt(v) for v in cells)
            + f" | {base / r['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--recipe", default="")
    parser.add_argument("--variants", default="sync,dp2,split0,split1")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="key=value for every variant")
    args = parser.parse_args()
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = [run_variant(n, root, root / names[0], args) for n in names]
    print(table(rows))
    write_results(
        {"steps": args.steps, "recipe": args.recipe or "default", "variants": rows}, args.out
    )


if __name__ == "__main__":
    main()
