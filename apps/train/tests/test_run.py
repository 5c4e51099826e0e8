"""`klppo-train` end to end on the embedded default (tiny: 2 PPO steps, short warm-up)."""

import json
import math
from pathlib import Path

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
