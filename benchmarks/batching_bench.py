"""Micro-batch planners side by side: fixed size with padding, verl's soft cap, our hard cap.

    ./uvw run python benchmarks/batching_bench.py [--batch 1024] [--max-len 4096]

For each length distribution, B sequences of up to ``max-len`` tokens are split with the
per-GPU budget ``suggest_token_budgets`` recommends (3x the longest sequence):

- fixed:   ``micro_batch_size_per_gpu`` = budget // max-len sequences per micro-batch, in
           input order, each micro-batch padded to its longest sequence;
- soft:    k = ceil(Σlen / budget) micro-batches balanced by compute (verl's dynamic bsz);
- ours:    :func:`batching.token_budget_micro_batches` (hard cap).

Columns: micro-batches; pad % = padding / processed tokens if each micro-batch is padded
to its longest sequence (packing makes it 0 for every planner); fill % = Σlen / (k ·
budget); max/mean of tokens and of compute (a·L + L²) per micro-batch; % of micro-batches
over the budget and the worst overshoot; planning time (median of 5) per batch.
Prints a table and writes ``benchmarks/results/batching_bench.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import numpy as np
from _results import RESULTS_DIR, write_results

from batching import (
    balanced_partitions,
    sequence_workloads,
    suggest_token_budgets,
    token_budget_micro_batches,
)

RESULTS = RESULTS_DIR / "batching_bench.json"


def distributions(batch: int, max_len: int, seed: int = 0) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    bimodal = np.where(
        rng.random(batch) < 0.6,
        rng.integers(32, max_len // 8, batch),
        rng.integers(max_len * 3 // 4, max_len + 1, batch),
    )
    outlier = rng.integers(32, max_len // 4, batch)
    outlier[::97] = max_len
    raw = {
        "uniform": rng.integers(32, max_len + 1, batch),
        "lognormal": np.clip(rng.lognormal(np.log(max_len / 6), 0.8, batch), 32, max_len),
        "bimodal": bimodal,
        "outliers": outlier,
    }
    return {name: [int(v) for v in lens] for name, lens in raw.items()}


def fixed_size(lens: list[int], budget: int, max_len: int) -> list[list[int]]:
    size = max(1, budget // max_len)
    return [list(range(i, min(i + size, len(lens)))) for i in range(0, len(lens), size)]


def soft_cap(lens: list[int], budget: int, max_len: int) -> list[list[int]]:
    return balanced_partitions(sequence_workloads(lens), math.ceil(sum(lens) / budget))


def hard_cap(lens: list[int], budget: int, max_len: int) -> list[list[int]]:
    return [list(mb) for mb in token_budget_micro_batches(lens, budget).micro_batches]


PLANNERS = {"fixed": fixed_size, "soft (verl)": soft_cap, "ours": hard_cap}


def measure(planner, lens: list[int], budget: int, max_len: int) -> dict:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        parts = planner(lens, budget, max_len)
        times.append(time.perf_counter() - start)
    tokens = [sum(lens[i] for i in p) for p in parts]
    weights = sequence_workloads(lens)
    compute = [sum(weights[i] for i in p) for p in parts]
    padded = sum(len(p) * max(lens[i] for i in p) for p in parts)
    over = [t for t in tokens if t > budget]
    return {
        "micro_batches": len(parts),
        "pad_pct": 100 * (padded - sum(lens)) / padded,
        "fill_pct": 100 * sum(lens) / (len(parts) * budget),
        "tokens_max_mean": max(tokens) / statistics.mean(tokens),
        "compute_max_mean": max(compute) / statistics.mean(compute),
        "over_cap_pct": 100 * len(over) / len(parts),
        "worst_overshoot_pct": 100 * (max(over) / budget - 1) if over else 0.0,
        "plan_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    budget = suggest_token_budgets(args.max_len // 4, args.max_len - args.max_len // 4).actor
    print(f"B={args.batch}, lengths ≤ {args.max_len}, budget {budget} tokens per micro-batch")
    header = (
        "| distribution | planner     | micro-batches | pad % | fill % | tok max/mean "
        "| compute max/mean | over cap % | worst over % | plan ms |"
    )
    print(header + "\n|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for dist_name, lens in distributions(args.batch, args.max_len).items():
        for planner_name, planner in PLANNERS.items():
            row = {
                "distribution": dist_name,
                "planner": planner_name,
                **measure(planner, lens, budget, args.max_len),
            }
            rows.append(row)
            print(
                f"| {dist_name:<12} | {planner_name:<11} | {row['micro_batches']:>13} "
                f"| {row['pad_pct']:>5.1f} | {row['fill_pct']:>6.1f} "
                f"| {row['tokens_max_mean']:>12.3f} | {row['compute_max_mean']:>16.3f} "
                f"| {row['over_cap_pct']:>10.1f} | {row['worst_overshoot_pct']:>12.1f} "
                f"| {row['plan_ms']:>7.1f} |"
            )
    write_results(
        {"batch": args.batch, "max_len": args.max_len, "budget": budget, "rows": rows}, args.out
    )


if __name__ == "__main__":
    main()
