"""benchmarks/fsdp_bench.py stays runnable: a tiny model through all six variants on 2 ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "no prefetch",
    "forward prefetch",
    "fwd+bwd prefetch",
    "reshard off",
    "grad checkpointing",
    "offload",
}


@pytest.mark.slow  # torchrun with 2 gloo processes
def test_fsdp_bench_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "fsdp_bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "fsdp_bench.py"),
        *("--hidden", "64", "--layers", "2", "--vocab", "128", "--seq-len", "16"),
        *("--batch", "2", "--steps", "1", "--nproc", "2", "--out", str(out)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "| no prefetch" in run.stdout
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == VARIANTS
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) <= 1e-5, losses
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    assert not list(tmp_path.glob("*.tmp"))
