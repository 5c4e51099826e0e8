"""Token budgets for SmolLM2-135M-Instruct on this machine: a sweep of hand-set budgets per
role beside what ``auto`` chooses.

    ./uvw run python benchmarks/budget_bench.py [--repeats 5]

The ``smollm2_arith`` recipe's shapes (prompts ≤ 64 tokens + 24 response tokens, 16 prompts ×
4 samples, one mini-batch) with every budget ``auto``: the models are built as a run builds
them (FSDP, ``model.dtype`` as the recipe says; the HF engine instead of vLLM, which the
budgets do not touch), then ``probe.choose_budgets`` chooses as at a run's start
(its seconds are the probe's cost). The sweep then measures each role's real pass --
actor/critic forward + backward, old/ref log-prob forwards -- at every budget of the series
(L, 2L, 4L, ... up to the role's cap, and auto's choice) ``--repeats`` times, in rounds over
the series, with the probe's own measurement (median seconds; peak memory growth of the
first round, in increasing order as the probe measures; CPU: peak RSS, CUDA:
max_memory_allocated).

Checks, as issue 14 states them: the auto budget's throughput is within 20 % of the best in
the sweep, and its peak memory is under the allowance. Prints the table and writes
``benchmarks/results/budget_bench.json``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from _results import RESULTS_DIR, with_trainer_allocator, write_results
from ppo_step_bench import RECIPE, prepare

from batching.budget_search import series
from klppo_train.checks.preflight import preflight
from klppo_train.config.roles import ROLES
from klppo_train.config.schema import load_config
from klppo_train.demo.sources import register_sources
from klppo_train.runtime.process_group import init_distributed
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.build import build_components
from klppo_train.trainer.measure import memory_allowance
from klppo_train.trainer.probe import choose_budgets, role_measure

RESULTS = RESULTS_DIR / "budget_bench.json"
WITHIN = 0.8  # auto's tokens/s ≥ 80 % of the sweep's best


def sweep(c, shape, role: str, repeats: int, auto: int) -> list[dict]:
    """Each budget of the series (and auto's choice) ``repeats`` times, in rounds over the
    whole series: a slow spell of the machine then falls on every budget alike instead of
    on one. Memory is the first round's (budgets in increasing order, as the probe
    measures: later rounds start with the largest pass's memory still cached)."""
    role_pass = c.pass_for(role)
    measure = role_measure(role_pass, shape, len(c.tokenizer))
    budgets = sorted({*series(shape.sequence, shape.cap(role_pass), growth=2), auto})
    points = {b: [] for b in budgets}
    for _ in range(repeats):
        for budget in budgets:
            points[budget].append(measure(budget))
    return [
        {
            "budget": budget,
            "tokens_per_s": budget / statistics.median(p.seconds for p in measured),
            "memory_gib": measured[0].memory_gib,
        }
        for budget, measured in points.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)  # 3 were not enough on a noisy VM
    args = parser.parse_args()
    with_trainer_allocator()  # the probe and the sweep run in this process, as in a run
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the probe's own table
    model, data = prepare()
    register_sources()  # the recipe names its model and data sources
    with tempfile.TemporaryDirectory(prefix="budget_bench_") as tmp:
        cfg = load_config(
            RECIPE,
            [
                f"model.path={model}",
                f"data.train_files=[{data / 'train.parquet'}]",
                f"data.val_files=[{data / 'val.parquet'}]",
                f"trainer.run_dir={tmp}",
                "rollout.engine=hf",
                *(f"{role.budget_key}=auto" for role in ROLES.values()),
            ],
        )
        checked = preflight(cfg)
        init_distributed()
        c = build_components(cfg, model, checked.tokenizer, checked.rewards)
        builder = StepBuilder(cfg)
        shape = builder.probe_shape()
        chosen = choose_budgets(c, builder.configured_budgets(), shape, Path(tmp) / "budgets.json")
        allowance, memory = memory_allowance(shape.memory_limit_gib, c)
        roles = {}
        for role in ROLES:
            if chosen.probe["roles"].get(role) is None:  # not in this recipe (a reward model)
                continue
            rows = sweep(c, shape, role, args.repeats, chosen.tokens[role])
            roles[role] = _verdict(rows, chosen.tokens[role], allowance)
            roles[role]["probe_seconds"] = chosen.probe["roles"][role]["seconds"]
    _print(roles, chosen.probe["seconds"], memory)
    write_results(
        {"probe_seconds": chosen.probe["seconds"], "memory": memory, "roles": roles}, RESULTS
    )
    return 0 if all(r["within_20pct"] and r["under_allowance"] for r in roles.values()) else 1


def _verdict(rows: list[dict], auto: int, allowance: float) -> dict:
    best = max(rows, key=lambda r: r["tokens_per_s"])
    mine = next(r for r in rows if r["budget"] == auto)
    return {
        "sweep": rows,
        "auto": auto,
        "best": best["budget"],
        "auto_vs_best": mine["tokens_per_s"] / best["tokens_per_s"],
        "within_20pct": mine["tokens_per_s"] >= WITHIN * best["tokens_per_s"],
        "under_allowance": mine["memory_gib"] <= allowance,
    }


def _print(roles: dict, probe_seconds: float, memory: dict) -> None:
    print(f"probe: {probe_seconds:.1f} s; allowance {memory['allowance_gib']:.2f} GiB")
    print("| role | budget | tokens/s | +GiB | |\n|---|---|---|---|---|")
    for role, found in roles.items():
        for row in found["sweep"]:
            mark = " ".join(
                m for m, on in (("auto", row["budget"] == found["auto"]),
                                ("best", row["budget"] == found["best"])) if on
            )  # fmt: skip
            print(
                f"| {ROLES[role].budget_key} | {row['budget']} | {row['tokens_per_s']:.0f} | "
                f"{row['memory_gib']:.3f} | {mark} |"
            )
        verdict = "ok" if found["within_20pct"] and found["under_allowance"] else "FAIL"
        print(
            f"|  | auto ÷ best tokens/s = {found['auto_vs_best']:.2f} ({verdict}); "
            f"probed in {found['probe_seconds']:.1f} s | | | |"
        )


if __name__ == "__main__":
    sys.exit(main())
