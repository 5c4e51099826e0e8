"""`klppo-train` end to end on the embedded default (tiny: 2 PPO steps, short warm-up)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from klppo_train.__main__ import main

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"


def overrides(run: Path) -> list[str]:
    return [
        str(RECIPE),
        f"trainer.run_dir={run}",
        f"data.train_files=[{run}/data/train.parquet]",
        f"data.val_files=[{run}/data/val.parquet]",
        "model.warmup_steps=10",
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "data.train_batch_size=8",
        "rollout.engine=hf",
    ]


def test_default_recipe_runs_end_to_end(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(overrides(run)) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        for key in (
            "actor/pg_loss",
            "critic/vf_loss",
            "critic/score/mean",
            "actor/grad_norm",
            "actor/reward_kl_penalty",
            "val/arithmetic/acc",
            "timing_s/gen",
            "rollout/logprob_diff_mean",
        ):
            assert math.isfinite(record[key]), key
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and "final_val/arithmetic/acc" in summary
    assert (run / "config.yaml").read_text().count("total_training_steps: 2") == 1
    assert '"steps": 2' in capsys.readouterr().out
    # the warmed-up embedded model is cached and reused by the next run
    weights = run / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert main(overrides(run)) == 0
    assert weights.stat().st_mtime_ns == stamp


@pytest.mark.slow  # starts vLLM (own process: vLLM patches process-wide torch settings)
def test_default_recipe_with_vllm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [a for a in overrides(run) if a != "rollout.engine=hf"] + ["rollout.engine=vllm"]
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "klppo_train", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # vLLM's sampling log-probs are the trainer's (fp32 on CPU, same weights after each sync)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records[1:])
    assert records[2]["actor/policy_version_sampled"] == 1
