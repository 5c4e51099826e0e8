"""benchmarks/rollout_bench.py stays runnable: a tiny model through both engines and a sync."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # imports and starts a vLLM engine (~30 s)
def test_rollout_bench_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "rollout_bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "rollout_bench.py"),
        *("--num-seqs", "4", "--new-tokens", "4", "--prompt-len", "8"),
        *("--hidden", "64", "--layers", "2", "--vocab", "128", "--head-dim", "32"),
        *("--kv-heads", "1", "--intermediate", "128", "--kv-cache-gib", "0.125"),
        *("--out", str(out)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "| vllm" in run.stdout and "| hf" in run.stdout
    data = json.loads(out.read_text())
    for engine in ("hf", "vllm"):
        assert data[engine]["tokens"] == 4 * 4
        assert data[engine]["tokens_per_s"] > 0
    assert data["sync"]["seconds_median"] > 0 and len(data["sync"]["seconds"]) == 3
    assert data["sync"]["ok"], data["sync"]  # one bucket, untied: the sync must be exact
    assert not list(tmp_path.glob("*.tmp"))
