"""Compare two runs' ``metrics.jsonl`` (a refactor must not change a seeded run): every value
but timings, throughput and memory, within a relative tolerance.

    python scripts/compare_metrics.py A/metrics.jsonl B/metrics.jsonl [--rtol 1e-5]

Exit 0 when every value agrees; prints the largest relative difference seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NOT_COMPARED = (
    "timing_s/",
    "perf/throughput",
    "perf/actor_update_tflops",
    "perf/max_rss_gb",
    "perf/max_memory",
)


def compare(a: list[dict], b: list[dict], rtol: float) -> tuple[float, int, list[str]]:
    """``(largest relative difference, values compared, disagreements)``."""
    worst, count, bad = 0.0, 0, []
    if len(a) != len(b):
        return worst, count, [f"{len(a)} records against {len(b)}"]
    for x, y in zip(a, b, strict=True):
        keys = {k for k in x if not k.startswith(NOT_COMPARED)}
        other = {k for k in y if not k.startswith(NOT_COMPARED)}
        if keys != other:
            bad.append(f"step {x.get('step')}: keys differ: {sorted(keys ^ other)}")
        for key in sorted(keys & other):
            count += 1
            diff = abs(x[key] - y[key])
            relative = diff / max(abs(x[key]), abs(y[key]), 1e-12)
            worst = max(worst, relative if diff > 1e-12 else 0.0)
            if diff > 1e-12 and relative > rtol:
                bad.append(f"step {x.get('step')} {key}: {x[key]} vs {y[key]} ({relative:.2e})")
    return worst, count, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args()
    runs = [
        [json.loads(line) for line in Path(path).read_text().splitlines()]
        for path in (args.a, args.b)
    ]
    worst, count, bad = compare(*runs, args.rtol)
    print(f"{len(runs[0])} records, {count} values compared, max relative difference {worst:.3e}")
    print("\n".join(bad) if bad else f"all within {args.rtol:g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
