"""benchmarks/multi_turn_bench.py stays runnable: a tiny model, prefix cache on and off."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two children, each imports vLLM and starts an engine (~30 s each)
def test_multi_turn_bench_tiny_model(tmp_path: Path) -> None:
    """Every conversation gets exactly its turns and lengths in both children (the bench
    raises otherwise); with the cache on, later turns reuse their history (hit rate > 0.3,
    fewer tokens prefilled), with it off nothing is reused."""
    out = tmp_path / "multi_turn_bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "multi_turn_bench.py"),
        *("--conversations", "4", "--turns", "3", "--turn-tokens", "8", "--user-tokens", "16"),
        *("--prompt-len", "160", "--hidden", "64", "--layers", "2", "--intermediate", "128"),
        "--kv-heads",
        "1",
        *("--kv-cache-gib", "0.125", "--out", str(out)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "| on |" in run.stdout and "| off |" in run.stdout
    data = json.loads(out.read_text())
    on, off = data["configs"]["on"], data["configs"]["off"]
    for c in (on, off):
        assert c["response_tokens"] == 3 * 8 + 2 * 16 and c["appended_per_turn"] == 16
        assert c["generated_tokens"] == 4 * 3 * 8
        assert c["multi_turn_s"] > 0 and c["single_turn_s"] > 0
    assert on["prefix_cache_hit_rate"] > 0.3, on
    assert off["prefix_cache_hit_rate"] == 0.0, off
    assert on["prefilled_tokens"] < off["prefilled_tokens"]
    assert not list(tmp_path.glob("*.tmp")) and not list(out.parent.glob("*.json.tmp"))
