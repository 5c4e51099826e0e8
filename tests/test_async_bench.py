"""benchmarks/async_bench.py stays runnable: two steps of a small embedded default,
synchronous and with a generating rank of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two short training runs, one of them under torchrun
def test_async_bench_reports_both_sides_idle_times(tmp_path: Path) -> None:
    out = tmp_path / "async_bench.json"
    small = [
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
    ]
    small += ["rollout.n=2", "model.warmup_steps=10"]
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "async_bench.py"),
        "--steps", "2", "--variants", "sync,split1", "--out", str(out), *small,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| sync |" in run.stdout and "| split1 |" in run.stdout
    sync, split = json.loads(out.read_text())["variants"]
    assert sync["steps"] == split["steps"] == 1
    assert sync["step_s"] > 0 and split["step_s"] > 0 and split["gen_s"] > 0
    assert sync["trainer_idle_s"] is None  # no generating rank
    assert split["trainer_idle_s"] >= 0 and split["generator_idle_s"] >= 0
    assert not list(out.parent.glob("*.tmp"))
