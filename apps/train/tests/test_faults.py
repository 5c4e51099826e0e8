"""Cluster faults at world size 2 under torchrun (gloo): one run survives rank 1 alone running
out of memory in each of the five passes, a SIGTERM to torchrun, and a ``kill -9`` of rank 1
that torchrun's ``--max-restarts`` recovers, and ends where the uninterrupted run does.
``scripts/fault_runs.py`` runs each fault many times at random points."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from fault_runs import (  # noqa: E402
    STEPS,
    difference,
    finish,
    launch,
    leftovers,
    prepared,
    rank_pid,
    records,
    wait_for_step,
)

from klppo_train.budgets.faults import ENV  # noqa: E402

# Rank 1 alone out of memory in every pass of step 1 (the update's second micro-batch).
OOM = "1:old_log_prob:0@1,1:ref:0@1,1:values:0@1,1:update_critic:1@1,1:update_actor:1@1"


@pytest.mark.slow  # three torchrun launches (one restarted) and the reference run: ~2 min
def test_one_run_survives_oom_on_one_rank_preemption_and_a_lost_rank(tmp_path: Path) -> None:
    faulted = tmp_path / "faulted"
    first = launch(faulted, env={ENV: OOM})
    wait_for_step(faulted, 2, first)
    first.send_signal(signal.SIGTERM)  # as a scheduler does: torchrun forwards it
    assert finish(first) != 0
    log = (tmp_path / "faulted.log").read_text()
    assert log.count("exit 143 (resume_mode=auto continues)") == 2, log[-3000:]  # both ranks
    stopped = records(faulted)[-1]["step"]
    assert 2 <= stopped < STEPS
    assert (faulted / f"checkpoints/global_step_{stopped}").is_dir()
    retries = [r.get("perf/oom_retries", 0) for r in records(faulted)]
    assert retries[1] == 5 and sum(retries) == 5  # every pass redone once, on both ranks
    budgets = json.loads((faulted / "budgets.json").read_text())["tokens"]

    second = launch(faulted, restarts=1)
    wait_for_step(faulted, stopped + 1, second)
    pid = rank_pid(faulted, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert finish(second) == 0  # torchrun restarted both workers; they resumed
    log = (tmp_path / "faulted.log").read_text()
    assert "local_rank: 1" in log and "exitcode: -9" in log, log[-3000:]  # named by torchrun

    reference = prepared(tmp_path, "reference", faulted)
    assert finish(launch(reference, budgets=budgets)) == 0
    got = records(faulted)
    assert [r["step"] for r in got] == list(range(STEPS + 1))  # each step once
    assert difference(got, records(reference)) <= 1e-6
    assert not leftovers(faulted)
