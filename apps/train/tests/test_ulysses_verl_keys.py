"""A verl user's Ulysses keys alone train the embedded default at world size 2 (issue 40):
``model.share_prompts`` left unset turns itself off and says so, and a normal start prints
no third-party warning about Triton."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
SHARING_OFF = (
    "model.share_prompts off: Ulysses sequence parallelism "
    "(actor.ulysses_sequence_parallel_size=2) does not share prompts"
)
# What a verl user sets for Ulysses (the reference and critic follow the actor's anyway).
VERL_ULYSSES = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
    "critic.ulysses_sequence_parallel_size=2",
)


@pytest.mark.slow  # two processes: the warm-up, vLLM's start on each rank, two PPO steps
def test_verl_ulysses_keys_alone_train_at_world_size_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [
        str(RECIPE),
        *VERL_ULYSSES,
        f"trainer.default_local_dir={run}",  # verl's trainer.run_dir
        "model.warmup_steps=10",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
    ]
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/klppo_vllm"),
        "OMP_NUM_THREADS": "1",
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node=2", "-m", "klppo_train", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.count(SHARING_OFF) == 1, done.stderr[-4000:]  # rank 0 says it
    assert "Triton not available" not in done.stdout + done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-2:] == [1, 2]
    config = (run / "config.yaml").read_text()
    assert "share_prompts: false" in config and "ulysses_sequence_parallel_size: 2" in config
