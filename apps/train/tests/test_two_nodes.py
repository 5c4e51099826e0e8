"""The synchronous and the async trainer as 2 nodes × 1 process on loopback (two torchrun
agents, c10d rendezvous on 127.0.0.1), as generating and training ranks sit on different
nodes: a ``kill -9`` of rank 1 mid-run, both agents restart their workers (``--max-restarts
1``; the failed node counts a restart, the other does not) and the run goes on from its
newest checkpoint, each step once."""

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from fault_runs import (  # noqa: E402
    STEPS,
    difference,
    finish,
    launch,
    launch_nodes,
    leftovers,
    prepared,
    rank_pid,
    records,
    wait_for_step,
)

AHEAD = ("async_training.enable=true", "async_training.rollout_ranks=1")  # rank 1 generates


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killed_and_restarted(run: Path, *extra: str) -> str:
    """Run on two nodes, ``kill -9`` rank 1 once step 2 is logged; both agents' logs."""
    nodes = launch_nodes(run, *extra, restarts=1, port=_port())
    wait_for_step(run, 2, nodes[0])
    pid = rank_pid(run, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert [finish(node) for node in nodes] == [0, 0]
    logs = "".join((run.parent / f"{run.name}.node{i}.log").read_text() for i in (0, 1))
    # the training ranks resumed (a generating rank has no checkpoint of its own)
    assert "exitcode: -9" in logs and "resumed from " in logs, logs[-3000:]
    assert [r["step"] for r in records(run)] == list(range(STEPS + 1))  # each step once
    assert not leftovers(run)
    return logs


@pytest.mark.slow  # two 2-node runs (each restarted once) and a 2-process reference: ~2 min
def test_two_nodes_restart_a_killed_rank_synchronous_and_async(tmp_path: Path) -> None:
    sync = tmp_path / "sync"
    _killed_and_restarted(sync)
    reference = prepared(tmp_path, "reference", sync)  # the same model and data, one node
    assert finish(launch(reference)) == 0
    assert difference(records(sync), records(reference)) <= 1e-6  # resumed bit for bit

    split = prepared(tmp_path, "split", sync)
    logs = _killed_and_restarted(split, *AHEAD)
    assert "the generating rank (rank 1) is gone" in logs  # named across nodes
    ages = [r["async/staleness_max"] for r in records(split)[1:]]
    assert max(ages) == 1.0 and ages[0] == 0.0  # the bound (s = 1) held across the restart
