"""trainer.allocator: the command line re-executes itself with an allocator that keeps freed
memory (tcmalloc preloaded where the system has it, else glibc's malloc with tunables) and
never with system; an allocator this system lacks is a config error. Real processes: the
allocator is fixed when one starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from klppo_train.runtime.allocator import allocator_env, find_tcmalloc, on_glibc, without_allocator

HAVE_TCMALLOC = find_tcmalloc() is not None
RETAINING = "allocator: glibc malloc retaining freed memory"


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # A missing data file: the run stops in the checks right after the allocator is chosen.
    missing = tmp_path / "missing.parquet"
    return subprocess.run(
        [sys.executable, "-m", "klppo_train", f"data.train_files=[{missing}]", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=without_allocator(dict(os.environ)),
    )


def _expected_log(setting: str) -> str:
    if setting == "system":
        return "allocator: system malloc"
    if setting != "glibc-retain" and HAVE_TCMALLOC:
        return "allocator: tcmalloc"
    return RETAINING


@pytest.mark.parametrize("setting", ["auto", "tcmalloc", "glibc-retain", "system"])
def test_allocator_setting_decides_what_the_process_runs_with(tmp_path, setting) -> None:
    done = _cli(tmp_path, f"trainer.allocator={setting}")
    assert done.returncode == 2, done.stderr[-2000:]
    if setting == "tcmalloc" and not HAVE_TCMALLOC:
        assert "trainer.allocator=tcmalloc: no libtcmalloc on this system" in done.stderr
        return
    assert _expected_log(setting) in done.stderr, done.stderr[-2000:]
    assert "missing.parquet' does not exist" in done.stderr  # the checks ran after it


# Five rounds in a worker thread (OpenMP workers allocate from their own arenas), each
# allocating 480 MiB in tensors of 8-40 MiB (every page written) and freeing them; the
# minor page faults of the last round. The allocator is set as the trainer sets it.
_FAULTS = """
import json, resource, sys, threading, torch
from klppo_train.runtime.allocator import use_allocator
use_allocator(sys.argv[1])
def rounds(out):
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(2 * (1 + i % 5), 2**20) for i in range(20)]
        del tensors
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
thread = threading.Thread(target=rounds, args=(out,))
thread.start(); thread.join()
print(json.dumps(out))
"""


def _last_round_faults(setting: str, env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, setting],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])[-1]


@pytest.mark.skipif(not on_glibc(), reason="glibc's tunables only exist on glibc")
def test_glibc_retain_keeps_freed_memory_where_system_malloc_gives_it_back() -> None:
    pages = 480 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    plain = without_allocator(dict(os.environ))
    system = _last_round_faults("system", plain)
    in_place = _last_round_faults("glibc-retain", plain)  # mallopt, as the trainer does
    started = _last_round_faults("system", allocator_env("glibc-retain", plain))  # a child
    # glibc raises its mmap threshold as it frees, up to 32 MiB: the 40 MiB ones stay.
    assert system > pages // 5  # given back on free: faulted in again
    assert in_place < pages // 20 and started < pages // 20  # reused as it is
