"""Weights and objects between a training and a generating rank (``rollout.stream``), under
torchrun with two real gloo processes (``stream_worker.py``)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow  # two processes
def test_weights_and_objects_cross_ranks_exactly_and_a_missing_version_times_out(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    run = subprocess.run(
        [*cmd, str(HERE / "stream_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=HERE,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    trainer, generator = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert trainer["own_world"] == generator["own_world"] == 1  # each side its own group
    assert generator["versions"] == [1, 2]
    assert generator["max_diff"] == 0.0  # version 2, bf16 as sent
    assert generator["object"] == [3, [0, 1, 2, 3, 4]]
    # the second sync returned while the receiver slept 2 s: sends never wait for the peer
    assert trainer["second_sync_s"] < 1.0
    assert trainer["bytes"] == trainer["first"]["rollout/weight_sync_bytes"] > 0
    timeout = generator["timeout"]
    assert 5.5 < timeout["waited_s"] < 20, timeout  # the group's 6 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes, twice
@pytest.mark.parametrize("mode", ["release", "die"])
def test_a_watched_peer_that_dies_is_named_at_once_and_one_that_ends_is_not(
    tmp_path: Path, mode: str
) -> None:
    port = _free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "watch_worker.py"), str(r), str(port), mode, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=HERE,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    assert ranks[0].returncode == 0, outputs[0][-3000:]
    watcher, peer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert watcher["objects"] == [0, 1, 2] and watcher["ended"]
    if mode == "release":
        assert watcher["lost"] is None and "lost_at" not in watcher
        # a receive with a timeout of its own waited past the group's 5 s
        assert watcher["late"] == "late" and 6.5 < watcher["late_waited_s"] < 30, watcher
    else:
        assert ranks[1].returncode == 9
        assert "Connection closed by peer" in watcher["lost"]
        # gloo sees the closed socket at once: far below the group's 5 s timeout
        assert 0 <= watcher["lost_at"] - peer["died_at"] < 1.0
