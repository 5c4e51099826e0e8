"""The benchmarks stay runnable: each one runs end to end on a tiny size and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from klppo_train.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def run_bench(name: str, tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    """Run ``benchmarks/<name>.py`` with ``args``; return its stdout and JSON rows."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert not list(tmp_path.glob("*.tmp"))  # written atomically
    return run.stdout, json.loads(out.read_text())["rows"]


def test_ppo_core_bench_runs_and_writes_json(tmp_path: Path) -> None:
    stdout, rows = run_bench("ppo_core_bench", tmp_path, "--sizes", "4x16", "--repeats", "1")
    assert "| compute_gae" in stdout
    assert {r["function"] for r in rows} == {"compute_gae", "policy_loss", "value_loss"}
    assert all(r["vectorized_ms"] > 0 and r["reference_ms"] > 0 for r in rows)


def test_batching_bench_runs_and_writes_json(tmp_path: Path) -> None:
    _, rows = run_bench("batching_bench", tmp_path, "--batch", "64", "--max-len", "1024")
    ours = [r for r in rows if r["planner"] == "ours"]
    assert len(ours) == 4
    assert all(r["over_cap_pct"] == 0.0 for r in ours)


@pytest.mark.slow
def test_ppo_step_bench_runs_a_real_step_and_writes_json(tmp_path: Path) -> None:
    """One bf16 step of the real SmolLM2 trainer run (the model is converted once, cached)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ppo_step_bench.py"), "--out", str(out)]
    cmd += ["--settings", "2x2x4", "--steps", "1", "--rows", "bf16", "--skip-forward"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["steps"]
    assert row["row"] == "bf16" and row["setting"] == "2x2x4"
    assert row["step_s"] > 0 and row["floor_s"] > 0 and row["step_over_floor"] > 1
    assert 0 < row["peak_rss_gb"] < 24
    assert "| 2x2x4 | bf16 |" in run.stdout


@pytest.mark.slow
def test_trl_ppo_bench_runs_trl_in_its_own_venv(tmp_path: Path) -> None:
    """TRL's PPO really runs (its own venv, pip + this machine's CPU torch), one tiny step."""
    out = tmp_path / "trl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_ppo_bench.py"), "--out", str(out)]
    cmd += ["--settings", "2x2x4", "--steps", "1", "--variants", "fp32"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["variant"] == "TRL fp32" and row["step_s"] > 0 and row["mixed_precision"] == "no"
    recipe = load_config(ROOT / "apps" / "train" / "recipes" / "smollm2_arith.yaml", [])
    assert row["lrs"] == [recipe.actor.lr, recipe.critic.lr]  # the recipe's, as klppo runs it
    assert row["kl_coef"] == recipe.algorithm.kl_ctrl.kl_coef
    assert result["versions"]["torch"].endswith("+cpu") and result["versions"]["trl"] == "1.12.0"
