"""Cluster faults at world size 2 (torchrun, gloo): each faulted run of the embedded default
against the uninterrupted run (issue 29).

    ./uvw run python scripts/fault_runs.py [--sigterm 10] [--kill 5] [--seed 0] [--out F.json]

Cases (a table row each; exit 1 if any fails):
- ``sigterm``: SIGTERM to torchrun at a random moment; the run stops at a step boundary with a
  checkpoint (workers exit 143), a relaunch resumes. Bit-identical metrics expected.
- ``kill``: ``kill -9`` of the whole job (torchrun and its workers) at a random moment; a
  relaunch resumes from the newest intact checkpoint. Bit-identical.
- ``oom``: ``KLPPO_FAULT_OOM`` on rank 1 only, one run per pass; compared with a run started at
  the backed-off budgets (relative 1e-6).
- ``truncated`` / ``bitflip``: the run stops after step 3; a file of its newest checkpoint is
  damaged; the relaunch resumes from step 2's. Bit-identical.
- ``2->1`` / ``1->2``: step 2's checkpoint resumed at the other world size (vLLM engine, one
  thread per process: the world-size test's setting); relative 1e-4.
Every run's ``metrics.jsonl`` must hold each step once (0..STEPS), and no ``*.tmp`` or
``*.partial`` may remain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from klppo_train.budgets.faults import ENV, PASSES
from klppo_train.config.roles import PASS_ROLES, ROLES

RECIPE = Path(__file__).resolve().parents[1] / "apps" / "train" / "recipes" / "default.yaml"
STEPS = 4
# the default recipe's budgets; in every pass of the first step one micro-batch at most
BUDGETS = {"actor": 512, "critic": 1024, "ref": 1024, "rollout": 8192}
NOT_COMPARED = ("timing_s/", "perf/")


def run_args(run: Path, engine: str = "hf", budgets: dict[str, int] | None = None) -> list[str]:
    """The embedded default at test size: 8 prompts × 4 samples, two mini-batches and two
    epochs per update, a checkpoint every step, validation at steps 2 and 4."""
    return [
        str(RECIPE),
        f"trainer.run_dir={run}",
        f"data.train_files=[{run}/data/train.parquet]",
        f"data.val_files=[{run}/data/val.parquet]",
        "model.warmup_steps=10",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
        "trainer.logger=file",
        "trainer.collective_timeout_s=120",  # a collective that never pairs fails, soon
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "actor.ppo_epochs=2",
        "critic.ppo_epochs=2",
        "rollout.n=4",
        f"rollout.engine={engine}",
        *(f"{ROLES[role].budget_key}={n}" for role, n in (budgets or BUDGETS).items()),
    ]


def launch(
    run: Path,
    *extra: str,
    nproc: int = 2,
    restarts: int = 0,
    env: dict | None = None,
    engine: str = "hf",
    budgets: dict[str, int] | None = None,
) -> subprocess.Popen:
    """The run under torchrun (``nproc`` ranks, ``restarts``: torchrun's ``--max-restarts``;
    ``nproc=0``: one plain process), its output appended to ``run.log``; a new session, so
    the whole job can be killed at once."""
    run.mkdir(parents=True, exist_ok=True)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
    ]
    command = [
        *(torchrun if nproc else [sys.executable]),
        "-m",
        "klppo_train",
        *run_args(run, engine, budgets),
        *extra,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.setdefault("VLLM_CACHE_ROOT", "/tmp/klppo_vllm")
    log = (run.parent / f"{run.name}.log").open("a")
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
    )


def launch_nodes(run: Path, *extra: str, restarts: int = 0, port: int) -> list[subprocess.Popen]:
    """The run as 2 nodes × 1 process on loopback: two torchrun agents (``--nnodes 2
    --node-rank 0|1``, c10d rendezvous on 127.0.0.1:``port``), each its own log
    (``run.node<i>.log``). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/distributed.md
    says for several nodes: torchrun's restart count is per node (the failed node's agent
    counts a restart, the other's does not), so rank 0 hosts a fresh store per attempt."""
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run.name}", f"--max-restarts={restarts}",
            "-m", "klppo_train", *run_args(run), *extra,
        ]  # fmt: skip
        log = (run.parent / f"{run.name}.node{node}.log").open("a")
        nodes.append(
            subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
    return nodes


def finish(process: subprocess.Popen, timeout: float = 600) -> int:
    return process.wait(timeout=timeout)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(run: Path, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``metrics.jsonl`` holds ``step`` (or the process ended)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if any(r["step"] == step for r in records(run)):
            return
        time.sleep(0.1)


def rank_pid(run: Path, rank: int) -> int | None:
    """The pid of the worker of ``run`` with ``RANK=rank``."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if f"trainer.run_dir={run}".encode() not in cmdline:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ and b"-m" in cmdline[:3]:
            return int(entry.name)
    return None


def difference(a: list[dict], b: list[dict]) -> float:
    """The largest difference of two runs' metrics (timings and perf/ aside), relative to
    the value where it is above 1 and absolute below (as the world-size test measures: a
    whitened mean of ~1e-7 has no relative precision); inf when their steps or keys differ."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for key, value in x.items():
            if not key.startswith(NOT_COMPARED):
                if key not in y:
                    return float("inf")
                worst = max(worst, abs(value - y[key]) / max(abs(value), abs(y[key]), 1.0))
    return worst


def leftovers(run: Path) -> list[str]:
    """Files a fault left half-written: ``*.tmp``, ``*.partial``."""
    return [str(p) for pattern in ("**/*.tmp", "**/*.partial") for p in run.glob(pattern)]


def prepared(root: Path, name: str, source: Path) -> Path:
    """A fresh run directory with ``source``'s warmed-up model and data (the same files)."""
    run = root / name
    for part in ("model", "data"):
        shutil.copytree(source / part, run / part)
    return run


def final_budgets(run: Path) -> dict[str, int]:
    return json.loads((run / "budgets.json").read_text())["tokens"]


def sigterm_case(run: Path, delay: float) -> tuple[int, str]:
    """SIGTERM to torchrun ``delay`` s after step 0 (the start's validation) was logged, then
    a relaunch; ``(first exit, note)``."""
    process = launch(run)
    wait_for_step(run, 0, process)
    time.sleep(delay)
    process.send_signal(signal.SIGTERM)
    code = finish(process)
    stopped = records(run)[-1]["step"] if records(run) else "-"
    assert finish(launch(run)) == 0
    return code, f"stopped after step {stopped}"


def kill_case(run: Path, delay: float) -> tuple[int, str]:
    """``kill -9`` of the whole job ``delay`` s after step 0 was logged, then a relaunch."""
    process = launch(run)
    wait_for_step(run, 0, process)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):  # it may have finished
        os.killpg(process.pid, signal.SIGKILL)
    code = finish(process)
    logged = records(run)[-1]["step"] if records(run) else "-"
    assert finish(launch(run)) == 0
    return code, f"killed with step {logged} logged"


def oom_case(root: Path, run: Path, pass_name: str, source: Path) -> tuple[Path, str]:
    """Rank 1 alone out of memory in ``pass_name`` at step 1; the run and its twin started
    at the budgets it ended with."""
    micro_batch = 1 if pass_name.startswith("update") else 0
    spec = f"1:{pass_name}:{micro_batch}@1"
    assert finish(launch(run, env={ENV: spec})) == 0
    retries = sum(r.get("perf/oom_retries", 0) for r in records(run))
    budgets = final_budgets(run)
    direct = prepared(root, f"{run.name}_direct", source)
    assert finish(launch(direct, budgets=budgets)) == 0
    role = PASS_ROLES[pass_name]
    return direct, f"{spec}: {retries:.0f} retry, {role} {BUDGETS[role]} -> {budgets[role]}"


def damage_case(run: Path, how: str) -> tuple[int, str]:
    """Stop after step 3; damage the largest file of checkpoint 3; relaunch."""
    assert finish(launch(run, "trainer.stop_at_step=3")) == 0
    target = max(
        (run / "checkpoints/global_step_3").rglob("*.distcp"), key=lambda p: p.stat().st_size
    )
    data = bytearray(target.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    code = finish(launch(run))
    damaged = (run / "checkpoints/global_step_3.damaged").is_dir()
    return code, f"{how} {target.name}; kept as .damaged: {damaged}"


def world_case(root: Path, source: Path, at: int, name: str) -> Path:
    """``source``'s step-2 checkpoint resumed at world size ``at`` (1: one process)."""
    run = root / name
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("actor_hf", "global_step_[34]*"))
    resume = f"trainer.resume_mode={run}/checkpoints/global_step_2"
    assert finish(launch(run, resume, nproc=0 if at == 1 else 2, engine="vllm")) == 0
    return run


def world_cases(root: Path, straight: Path, row) -> None:
    """Uninterrupted runs at world size 1 and 2 (vLLM), each one's step-2 checkpoint resumed
    at the other size."""
    one, two = root / "one", root / "two"
    for run, nproc in ((one, 0), (two, 2)):
        prepared(root, run.name, straight)
        assert finish(launch(run, "trainer.max_ckpt_to_keep=0", nproc=nproc, engine="vllm")) == 0
    row("2->1", world_case(root, two, 1, "two_at_one"), records(one), 1e-4, "vLLM, vs world size 1")
    row("1->2", world_case(root, one, 2, "one_at_two"), records(two), 1e-4, "vLLM, vs world size 2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sigterm", type=int, default=10)
    parser.add_argument("--kill", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default="sigterm,kill,oom,damaged,world")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="fault_runs_"))
    rows: list[dict] = []

    def row(case: str, run: Path, reference: list[dict], tolerance: float, note: str) -> None:
        got = records(run)
        diff = difference(got, reference)
        continuous = [r["step"] for r in got] == list(range(STEPS + 1))
        ok = diff <= tolerance and continuous and not leftovers(run)
        rows.append({"case": case, "note": note, "diff": diff, "ok": ok})
        print(f"| {case} | {note} | {diff:.1e} | {'yes' if ok else 'NO'} |", flush=True)

    print(f"runs in {root}\n| case | what happened | largest diff | ok |\n|---|---|---|---|")
    straight = root / "straight"
    process = launch(straight)
    wait_for_step(straight, 0, process)
    start = time.monotonic()
    wait_for_step(straight, STEPS, process)
    took = time.monotonic() - start  # the steps: where the faults land
    assert finish(process) == 0
    reference = records(straight)
    cases = set(args.cases.split(","))
    for i in range(args.sigterm if "sigterm" in cases else 0):
        run = prepared(root, f"sigterm{i}", straight)
        delay = rng.uniform(0.0, took)
        code, note = sigterm_case(run, delay)
        row("sigterm", run, reference, 0.0, f"{delay:.1f} s after step 0: exit {code}, {note}")
    for i in range(args.kill if "kill" in cases else 0):
        run = prepared(root, f"kill{i}", straight)
        delay = rng.uniform(0.0, took)
        code, note = kill_case(run, delay)
        row("kill -9 job", run, reference, 0.0, f"{delay:.1f} s after step 0: {note}")
    for name in PASSES if "oom" in cases else ():
        if PASS_ROLES[name] in BUDGETS:  # the passes this recipe runs
            run = prepared(root, f"oom_{name}", straight)
            direct, note = oom_case(root, run, name, straight)
            row("oom rank 1", run, records(direct), 1e-6, note)
    for how in ("truncated", "bitflip") if "damaged" in cases else ():
        run = prepared(root, how, straight)
        code, note = damage_case(run, how)
        row("damaged", run, reference, 0.0, f"{note}; exit {code}")
    if "world" in cases:
        world_cases(root, straight, row)
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} of {len(rows)} runs passed")
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps({"rows": rows}, indent=2))
        os.replace(tmp, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
