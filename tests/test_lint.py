"""The root ruff configuration holds for the whole tree (lint and format)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    ruff = Path(sys.executable).with_name("ruff")
    run = subprocess.run(
        [str(ruff), *args, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
