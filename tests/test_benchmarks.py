"""The benchmarks stay runnable: each one runs end to end on a tiny size and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klppo_train.config.schema import load_config

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


@pytest.mark.parametrize(
    ("shared", "critic", "flops"), [(True, True, 4320), (False, True, 5280), (True, False, 3200)]
)
def test_work_floor_counts_the_matmuls_the_trainer_runs(
    monkeypatch: pytest.MonkeyPatch, shared: bool, critic: bool, flops: int
) -> None:
    """Hand-derived: 100 tokens of which 60 response (kept), 4 samples a prompt, so each
    prompt's 40 copied tokens run as 10 when shared; body 2 and head 3 parameters; reference
    and values ran, no old-log-prob pass. Shared: a token run = 70, actor pass 2·2·70 +
    2·3·60 = 640, critic pass 280; reference + values 920, updates 3·920, generation 2·2·10
    + 2·5·60 = 640: 4320. Unshared: 100 tokens run, 760 + 400 = 1160, 3·1160, 640: 5280.
    GRPO (no critic: no values, no critic update), shared: 640 + 3·640 + 640 = 3200."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ppo_step_bench import work_floor_s

    m = {"perf/throughput": 10.0, "timing_s/step": 10.0, "perf/response_tokens": 60.0}
    m.update({"timing_s/ref": 1.0, "timing_s/update_actor": 1.0})
    if critic:
        m.update({"timing_s/values": 1.0, "timing_s/update_critic": 1.0})
    assert work_floor_s(m, (2, 3), 1e-9, 4, shared) == pytest.approx(flops)


@pytest.mark.parametrize(("critic", "flops"), [(True, 1720), (False, 920)])
def test_step_floor_counts_the_passes_that_ran(
    monkeypatch: pytest.MonkeyPatch, critic: bool, flops: int
) -> None:
    """Hand-derived, one parameter: 100 tokens, 10 samples of 6 generated tokens (2·60 =
    120). PPO: two updates 2·6·100, reference + values 2·2·100: 1720. GRPO: one update 600,
    the reference 200: 920."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ppo_step_bench import step_floor_s

    m = {"perf/throughput": 10.0, "timing_s/step": 10.0, "response_length/mean": 6.0}
    m.update({"timing_s/ref": 1.0, "timing_s/update_actor": 1.0})
    if critic:
        m.update({"timing_s/values": 1.0, "timing_s/update_critic": 1.0})
    assert step_floor_s(m, 1, 1e-9, 10) == pytest.approx(flops)


def probed_dtype() -> str:
    """What ``model.dtype=auto`` picks on this machine (the trainer's own probe): a test
    forces bf16 only where it is fast (on an AVX2-only CPU a bf16 step ran 50x over fp32's)."""
    from klppo_train.runtime.precision import resolve_precision

    auto = resolve_precision("auto", torch.device("cpu"))
    return "bf16" if auto.dtype == torch.bfloat16 else "fp32"


@pytest.mark.slow  # the SmolLM2 trainer in its own process
def test_ppo_step_bench_runs_a_real_step_and_writes_json(tmp_path: Path) -> None:
    """One LoRA step of the real SmolLM2 trainer run (the model is converted once, cached),
    in the dtype this machine's probe picks: the row runs, its floors count no weight
    gradients, the sync sends adapters."""
    dtype = probed_dtype()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ppo_step_bench.py"), "--out", str(out)]
    cmd += ["--settings", "2x2x4", "--steps", "1", "--rows", f"{dtype}+lora8", "--skip-forward"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["steps"]
    assert row["row"] == f"{dtype}+lora8" and row["setting"] == "2x2x4"
    # rank 8 on SmolLM2's linear layers: per layer 8·Σ(in + out) over q, k, v, o (576→576,
    # 576→192 twice, 576→576) and gate, up, down (576↔1536) = 8 · 10176; 30 layers; 2 or 4
    # bytes each
    width = 2 if dtype == "bf16" else 4
    assert row["sync_mb"] == pytest.approx(width * 8 * 10176 * 30 / 1e6)
    assert row["step_s"] > 0 and row["floor_s"] > 0 and row["step_over_floor"] > 1
    # prompts shared and logits only where kept: less work than the step floor counts
    assert 0 < row["work_floor_s"] < row["floor_s"]
    assert row["step_over_work_floor"] == pytest.approx(row["step_s"] / row["work_floor_s"])
    assert 0 < row["peak_rss_gb"] < 24
    assert f"| 2x2x4 | {dtype}+lora8 |" in run.stdout


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


@pytest.mark.slow
def test_trl_grpo_bench_runs_both_sides(tmp_path: Path) -> None:
    """TRL's GRPOTrainer with LoRA really runs (its own venv) beside klppo's GRPO LoRA recipe,
    one tiny step each, with the recipe's numbers."""
    out = tmp_path / "trl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_grpo_bench.py"), "--out", str(out)]
    cmd += ["--settings", "2x2x4", "--steps", "1", "--variants", "fp32+lora"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    ours, trl = result["rows"]
    assert ours["variant"] == "klppo lora fp32" and ours["step_s"] > 0  # the variant's dtype
    assert 0 < ours["work_floor_s"] < ours["floor_s"] < ours["step_s"]
    assert trl["variant"] == "TRL fp32+lora" and trl["step_s"] > 0
    assert trl["trl_over_klppo"] == pytest.approx(trl["step_s"] / ours["step_s"])
    recipe = load_config(ROOT / "apps" / "train" / "recipes" / "smollm2_arith_grpo_lora.yaml", [])
    assert trl["lr"] == recipe.actor.lr and trl["beta"] == recipe.actor.kl_loss_coef
    # rank 32 on every linear layer of SmolLM2 (as the LoRA bench row: 32 · 10176 per layer,
    # 30 layers); the reference is the policy with its adapter off, not a second model
    assert trl["trained"] == 32 * 10176 * 30 and trl["ref_model"] is False
    assert result["versions"]["trl"] == "1.16.0" and trl["mixed_precision"] == "no"
