"""The OOM back-off under random faults: runs of the embedded default with out-of-memory
errors injected at random steps, passes and micro-batches (``KLPPO_FAULT_OOM``), each
against an uninjected run whose token budgets start where the back-off ended.

    ./uvw run python scripts/oom_fault_runs.py [--runs 20] [--seed 0]

Each run: the embedded default recipe for 6 steps at test size (8 prompts × 4 samples, HF
engine, fp32), 1-3 faults. Checks per run: all 6 steps ran, ``perf/oom_retries`` adds up to
the faults, and every per-step metric (timings and ``perf/*`` aside) equals the uninjected
run's within 1e-5. One table row per run; exit 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

from klppo_train.__main__ import main as train
from klppo_train.budgets.faults import ENV, PASSES
from klppo_train.config.roles import ROLES

RECIPE = Path(__file__).resolve().parents[1] / "apps" / "train" / "recipes" / "default.yaml"
STEPS = 6
START = {"actor": 512, "critic": 1024, "ref": 1024, "rollout": 8192}
UPDATES = ("update_actor", "update_critic")  # two mini-batches: micro-batches 0 and 1 exist


def run_args(run: Path, budgets: dict[str, int]) -> list[str]:
    data = run / "data"  # the embedded default writes its data there (and only there)
    return [
        str(RECIPE),
        f"trainer.run_dir={run}",
        f"data.train_files=[{data}/train.parquet]",
        f"data.val_files=[{data}/val.parquet]",
        "model.warmup_steps=10",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=3",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "rollout.n=4",
        "rollout.engine=hf",
        *(f"{ROLES[role].budget_key}={tokens}" for role, tokens in budgets.items()),
    ]


def random_faults(rng: random.Random) -> list[tuple[int, str, int]]:
    chosen: dict[tuple[int, str], int] = {}
    while len(chosen) < rng.randint(1, 3):
        step, name = rng.randint(1, STEPS), rng.choice(PASSES)
        chosen[(step, name)] = rng.randint(0, 1) if name in UPDATES else 0
    return [(step, name, index) for (step, name), index in sorted(chosen.items())]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def largest_difference(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            if not key.startswith(("timing_s/", "perf/")):
                scale = max(abs(value), abs(y[key]), 1.0)
                worst = max(worst, abs(value - y[key]) / scale)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="oom_fault_runs_"))
    direct: dict[tuple, list[dict]] = {}
    failures = 0
    print("| run | faults | retries | budgets after (actor, critic, ref, rollout) | diff | ok |")
    print("|---|---|---|---|---|---|")
    for i in range(args.runs):
        faults = random_faults(rng)
        run = root / f"run{i}"
        os.environ[ENV] = ",".join(f"{s}:{p}:{m}" for s, p, m in faults)
        code = train(run_args(run, START))
        del os.environ[ENV]
        if code != 0 or not (run / "metrics.jsonl").is_file():
            failures += 1
            print(f"| {i} | {faults} | - | - | - | NO (exit {code}) |")
            continue
        final = json.loads((run / "budgets.json").read_text())["tokens"]
        key = tuple(final[role] for role in START)
        if key not in direct:
            plain = root / f"direct{len(direct)}"
            assert train(run_args(plain, final)) == 0
            direct[key] = records(plain)
        got = records(run)
        retries = sum(r.get("perf/oom_retries", 0) for r in got)
        diff = largest_difference(got, direct[key]) if len(got) == STEPS + 1 else math.inf
        ok = code == 0 and len(got) == STEPS + 1 and retries == len(faults) and diff <= 1e-5
        failures += not ok
        spec = ",".join(f"{s}:{p}:{m}" for s, p, m in faults)
        print(f"| {i} | {spec} | {retries:.0f} | {key} | {diff:.1e} | {'yes' if ok else 'NO'} |")
    print(f"{args.runs - failures} of {args.runs} runs passed ({root})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
