"""Time ppo_core's GAE and losses against the pure-Python reference loops, side by side.

    ./uvw run python benchmarks/ppo_core_bench.py [--sizes 256x1024 1024x4096] [--repeats 5]

Prints a table and writes ``benchmarks/results/ppo_core_bench.json``. Both sides run in the
same process on the same inputs, so the ratio column is what to compare across machines;
absolute times on a shared 2-core VM move by ±30 %. The reference timings include
converting the tensors to Python lists (that is part of what a loop costs).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import time
from pathlib import Path

import torch
from _results import RESULTS_DIR, write_results

import ppo_core

ROOT = Path(__file__).resolve().parents[1]
RESULTS = RESULTS_DIR / "ppo_core_bench.json"


def load_reference():
    path = ROOT / "packages" / "ppo_core" / "tests" / "reference.py"
    spec = importlib.util.spec_from_file_location("ppo_core_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()

    def randn():
        return torch.randn(batch, length, generator=gen)

    return {
        "rewards": randn() * 0.1,
        "values": randn(),
        "old_values": randn(),
        "logprob": -randn().abs(),
        "old_logprob": -randn().abs(),
        "mask": mask,
    }


def cases(x: dict[str, torch.Tensor], ref):
    """(name, vectorized callable, reference callable) for each benchmarked function."""
    return [
        (
            "compute_gae",
            lambda: ppo_core.compute_gae(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
            lambda: ref.ref_compute_gae(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
        ),
        (
            "policy_loss",
            lambda: ppo_core.policy_loss(x["logprob"], x["old_logprob"], x["values"], x["mask"]),
            lambda: ref.ref_policy_loss(x["logprob"], x["old_logprob"], x["values"], x["mask"]),
        ),
        (
            "value_loss",
            lambda: ppo_core.value_loss(x["values"], x["old_values"], x["rewards"], x["mask"]),
            lambda: ref.ref_value_loss(x["values"], x["old_values"], x["rewards"], x["mask"]),
        ),
    ]


def seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(sizes: list[tuple[int, int]], repeats: int, reference_repeats: int) -> list[dict]:
    ref = load_reference()
    rows = []
    for batch, length in sizes:
        x = make_inputs(batch, length)
        for name, vectorized, reference in cases(x, ref):
            vec_s = seconds(vectorized, repeats)
            ref_s = seconds(reference, reference_repeats)
            rows.append(
                {
                    "function": name,
                    "B": batch,
                    "T": length,
                    "vectorized_ms": vec_s * 1e3,
                    "reference_ms": ref_s * 1e3,
                    "speedup": ref_s / vec_s,
                }
            )
            print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    print(
        f"| {row['function']:<12} | {row['B']:>5} | {row['T']:>5} | {row['vectorized_ms']:>12.1f} "
        f"| {row['reference_ms']:>13.1f} | {row['speedup']:>8.0f}x |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["256x1024", "1024x4096"], help="BxT pairs")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (vectorized)")
    parser.add_argument("--reference-repeats", type=int, default=1, help="timed calls (loops)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print("| function     |     B |     T | vectorized ms | reference ms |  speedup |")
    print("|--------------|-------|-------|---------------|--------------|----------|")
    rows = run(sizes, args.repeats, args.reference_repeats)
    write_results(
        {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, args.out
    )


if __name__ == "__main__":
    main()
