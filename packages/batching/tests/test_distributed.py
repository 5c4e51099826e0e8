"""sync_num_micro_batches across 2 real gloo processes (torchrun), then a forced re-plan."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batching import sync_num_micro_batches

WORKER = Path(__file__).with_name("dist_sync_worker.py")


def test_without_process_group_returns_input() -> None:
    assert sync_num_micro_batches(3) == 3


@pytest.mark.slow
def test_two_ranks_agree_on_the_max_count(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--standalone",
        str(WORKER),
        str(tmp_path),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 0: 1400 tokens fit in 2; rank 1: no two of its sequences fit together, so 6
    assert [r["own"] for r in ranks] == [2, 6]
    assert [r["synced"] for r in ranks] == [6, 6]
    assert [r["steps"] for r in ranks] == [6, 6]
    assert sorted(ranks[0]["sums"]) == [100, 150, 200, 250, 300, 400]
