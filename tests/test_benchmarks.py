"""The benchmarks stay runnable: each one runs end to end on a tiny size and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ppo_core_bench_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "ppo_core_bench.py"),
        "--sizes",
        "4x16",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "| compute_gae" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["function"] for r in rows} == {"compute_gae", "policy_loss", "value_loss"}
    assert all(r["vectorized_ms"] > 0 and r["reference_ms"] > 0 for r in rows)
    assert not list(tmp_path.glob("*.tmp"))


def test_batching_bench_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "batching_bench.py"),
        "--batch",
        "64",
        "--max-len",
        "1024",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["planner"] == "ours"]
    assert len(ours) == 4
    assert all(r["over_cap_pct"] == 0.0 for r in ours)
