"""trainer.allocator: the command line re-executes itself with tcmalloc preloaded where the
system has it (auto, tcmalloc) and never with system; tcmalloc without the library is a
config error. Real processes: the allocator is fixed when one starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from klppo_train.allocator import find_tcmalloc

HAVE_TCMALLOC = find_tcmalloc() is not None


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # A missing data file: the run stops in the checks right after the allocator is chosen.
    missing = tmp_path / "missing.parquet"
    return subprocess.run(
        [sys.executable, "-m", "klppo_train", f"data.train_files=[{missing}]", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("setting", ["auto", "tcmalloc", "system"])
def test_allocator_setting_decides_what_the_process_runs_with(tmp_path, setting) -> None:
    done = _cli(tmp_path, f"trainer.allocator={setting}")
    assert done.returncode == 2, done.stderr[-2000:]
    if setting == "tcmalloc" and not HAVE_TCMALLOC:
        assert "trainer.allocator=tcmalloc: no libtcmalloc on this system" in done.stderr
        return
    uses_tcmalloc = setting != "system" and HAVE_TCMALLOC
    expected = "allocator: tcmalloc" if uses_tcmalloc else "allocator: system malloc"
    assert expected in done.stderr, done.stderr[-2000:]
    assert "missing.parquet' does not exist" in done.stderr  # the checks ran after it
