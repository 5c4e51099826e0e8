"""2 gloo ranks, one in-process vLLM engine each: FSDP-sharded weights sync into every engine.

Runs ``dist_rollout_worker.py`` under torchrun (about 40 s with a warm ``VLLM_CACHE_ROOT``, +30 s
on the first start with an empty one).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist_rollout")
    out = tmp / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / "dist_rollout_worker.py"),
        str(tmp / "model"),
        str(out),
    ]
    # the worker defaults VLLM_CACHE_ROOT to /tmp/klppo_vllm_cache (kept across runs)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())["ranks"]


def test_each_rank_served_its_own_prompts(ranks) -> None:
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    for r in ranks:
        for phase in ("before", "after"):
            assert r[phase]["num_samples"] == 2 * len(r["prompts"])  # n=2
            assert r[phase]["num_tokens"] > 0


def test_stamps_are_version_0_then_1(ranks) -> None:
    for r in ranks:
        assert r["before"]["batch_version"] == 0 and r["before"]["sample_versions"] == [0]
        assert r["after"]["batch_version"] == 1 and r["after"]["sample_versions"] == [1]
        assert r["engine_version"] == 1


def test_synced_engine_matches_unsharded_perturbed_model(ranks) -> None:
    for r in ranks:
        assert r["before"]["max_diff"] <= 1e-4, r["before"]
        assert r["after"]["max_diff"] <= 1e-4, r["after"]
        # the sync really changed the engine's weights
        assert r["after"]["max_diff_vs_original"] > 1e-2, r["after"]


def test_sync_moved_every_parameter(ranks) -> None:
    # tiny Qwen2, float32: embeddings + lm_head 2*128*64, 2 layers of 37_120, final norm 64
    expected = 4 * (2 * 128 * 64 + 2 * 37_120 + 64)
    for r in ranks:
        assert r["sync"]["rollout/weight_sync_bytes"] == expected
        assert r["sync"]["timing_s/update_weights"] > 0
