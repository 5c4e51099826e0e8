"""benchmarks/ulysses_bench.py stays runnable: a tiny model's update at sp = 1 and 2, 2 ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # torchrun with 2 gloo processes
def test_ulysses_bench_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "ulysses_bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ulysses_bench.py"), "--out", str(out)]
    cmd += ["--hidden", "64", "--layers", "2", "--vocab", "128", "--lengths", "256,512"]
    cmd += ["--trainer-response", "0"]  # not the trainer runs (~3 min; numbers in the docs)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "| memory sp2/sp1 |" in run.stdout
    data = json.loads(out.read_text())
    rows = [(r["length"], r["sp"]) for r in data["rows"]]
    assert rows == [(256, 1), (256, 2), (512, 1), (512, 2)]
    assert all(r["seconds"] > 0 and r["peak_gib"] >= 0 for r in data["rows"])
    assert set(data["ratios"]) == {"256", "512"} and data["world_size"] == 2
    assert not list(tmp_path.glob("*.tmp"))
