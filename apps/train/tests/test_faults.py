"""Cluster faults at world size 2 under torchrun (gloo): one run survives rank 1 alone running
out of memory in each of the five passes, a SIGTERM to torchrun, and a ``kill -9`` of rank 1
that torchrun's ``--max-restarts`` recovers, and ends where the uninterrupted run does.
``scripts/fault_runs.py`` runs each fault many times at random points."""

import json
import os
import re
import signal
import sys
import time
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

AHEAD = ("async_training.enable=true", "async_training.rollout_ranks=1")  # rank 1 generates
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


def _logged_at(log: Path, text: str, since: int, timeout: float = 60.0) -> float | None:
    """When ``text`` first appeared in ``log`` past its first ``since`` characters."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text()[since:]:
            return time.monotonic()
        time.sleep(0.01)
    return None


@pytest.mark.slow  # two torchrun launches (one restarted) per world size: ~1 min, ~2 min
@pytest.mark.parametrize("world", [2, 3])
def test_a_generating_rank_of_its_own_survives_preemption_and_a_kill(
    tmp_path: Path, world: int
) -> None:
    """``async_training.rollout_ranks=1`` (s = 1) at world size 2 and 3 (1 or 2 training
    ranks): a SIGTERM stops every rank with a checkpoint; the relaunch regenerates the batch
    that was in flight (its step is on-policy) and keeps the bound; a ``kill -9`` of the
    generating rank is named by the training ranks at once, which still checkpoint the step
    they were in (torchrun's SIGTERM), and torchrun's restart goes on from there: each step
    once."""
    run, log = tmp_path / "split", tmp_path / "split.log"
    generator = world - 1
    first = launch(run, *AHEAD, nproc=world)
    wait_for_step(run, 1, first)
    first.send_signal(signal.SIGTERM)
    assert finish(first) != 0
    assert log.read_text().count("exit 143 (resume_mode=auto continues)") == world, log.read_text()
    stopped = records(run)[-1]["step"]
    assert 1 <= stopped < STEPS - 1 and (run / f"checkpoints/global_step_{stopped}").is_dir()

    since = len(log.read_text())
    second = launch(run, *AHEAD, nproc=world, restarts=1)
    wait_for_step(run, stopped + 1, second)
    pid = rank_pid(run, generator)
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    named = _logged_at(log, f"the generating rank (rank {generator}) is gone: ", since)
    assert named is not None and named - killed < 1.0, log.read_text()[since:]
    assert finish(second) == 0
    text = log.read_text()[since:]
    assert f"local_rank: {generator}" in text and "exitcode: -9" in text, text  # torchrun too
    # each training rank says where it resumed: the relaunch at ``stopped``, then the restart
    resumed = sorted({int(n) for n in re.findall(r"resumed from \S+global_step_(\d+)", text)})
    got = records(run)
    assert [r["step"] for r in got] == list(range(STEPS + 1))  # each step once
    assert len(resumed) == 2 and resumed[0] == stopped, text
    ages = {r["step"]: r["async/staleness_max"] for r in got[1:]}
    assert max(ages.values()) <= 1.0  # the bound holds across both resumes
    for step in resumed:
        if step < STEPS:
            assert ages[step + 1] == 0.0  # the batch in flight, regenerated with its weights
    assert not leftovers(run)


@pytest.mark.slow  # one torchrun launch: ~40 s
def test_a_generating_rank_that_hangs_is_named_after_the_link_timeout(tmp_path: Path) -> None:
    """A stopped generating rank (SIGSTOP) keeps its connection open, so no watch sees it go:
    the training rank's next wait on the link (a batch, or the weights' send) fails after
    ``trainer.collective_timeout_s`` with one line naming it, and the job ends; it never
    hangs."""
    run, log = tmp_path / "split", tmp_path / "split.log"
    job = launch(run, *AHEAD, "trainer.collective_timeout_s=5")
    wait_for_step(run, 1, job)
    pid = rank_pid(run, 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    named = _logged_at(log, "the generating rank (rank 1) did not answer over the link", 0)
    os.kill(pid, signal.SIGCONT)  # so that torchrun's SIGTERM can end it
    assert named is not None and named - stopped < 5 + 15, log.read_text()[-3000:]
    assert finish(job, timeout=120) != 0
    said = [line for line in log.read_text().splitlines() if "(rank 1) did not answer" in line]
    assert len(said) == 1 and said[0].startswith("klppo-train: error: "), said
    assert "Timed out" in said[0] and "(rank 1) is gone" not in log.read_text()
    assert "the generating rank (rank 1) stopped answering" in log.read_text()  # the watch
    assert re.search(r'File ".*klppo_train', log.read_text()) is None  # no traceback of ours
