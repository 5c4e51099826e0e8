"""Every package builds on its own, and the ppo_core wheel works in a venv that has only torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {
    "klppo-ppo-core": "ppo_core",
    "klppo-batching": "batching",
    "klppo-fsdp-sharding": "fsdp_sharding",
    "klppo-rollout": "rollout",
    "klppo-train": "klppo_train",
}
FOLDERS = {
    "klppo-ppo-core": "packages/ppo_core",
    "klppo-batching": "packages/batching",
    "klppo-fsdp-sharding": "packages/fsdp_sharding",
    "klppo-rollout": "packages/rollout",
    "klppo-train": "apps/train",
}
pytestmark = pytest.mark.slow


def uv(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # `uv run` puts the running uv on PATH as $UV; fall back to `python -m uv`.
    exe = [os.environ["UV"]] if "UV" in os.environ else [sys.executable, "-m", "uv"]
    result = subprocess.run([*exe, *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, f"uv {' '.join(args)} failed:\n{result.stderr}"
    return result


def version(dist: str) -> str:
    """The version in the distribution's own pyproject.toml."""
    pyproject = tomllib.loads((ROOT / FOLDERS[dist] / "pyproject.toml").read_text())
    return pyproject["project"]["version"]


def cpu_torch_dir() -> str:
    """The flat index the root pyproject's MACHINE-SPECIFIC block points torch at."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (index,) = [i for i in config["tool"]["uv"]["index"] if i["name"] == "machine-local-cpu-torch"]
    return index["url"].removeprefix("file://")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    built = {}
    for dist in DISTRIBUTIONS:
        uv("build", "--package", dist, "--out-dir", str(out), "--quiet")
        (wheel,) = out.glob(f"{dist.replace('-', '_')}-*.whl")
        built[dist] = wheel
    return built


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_wheel_has_its_module_and_marker(wheels: dict[str, Path], dist: str) -> None:
    names = zipfile.ZipFile(wheels[dist]).namelist()
    module = DISTRIBUTIONS[dist]
    assert f"{module}/__init__.py" in names
    assert f"{module}/py.typed" in names
    assert f"-{version(dist)}-" in wheels[dist].name


def test_app_wheel_pins_each_package_from_its_lower_bound(wheels: dict[str, Path]) -> None:
    """The published metadata keeps the pyproject's ranges (an old package wheel is refused)."""
    wheel = zipfile.ZipFile(wheels["klppo-train"])
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    lines = wheel.read(meta).decode().splitlines()
    published = {
        r.name: r.specifier
        for r in (
            Requirement(line.split(":", 1)[1])
            for line in lines
            if line.startswith("Requires-Dist:")
        )
    }
    pyproject = tomllib.loads((ROOT / "apps/train/pyproject.toml").read_text())
    for text in pyproject["project"]["dependencies"]:
        req = Requirement(text)
        if req.name in DISTRIBUTIONS:
            assert published[req.name] == req.specifier, (req.name, published[req.name])
            assert version(req.name) in req.specifier
            assert not req.specifier.contains("0.1.0"), f"{text}: admits the old 0.1.0 wheels"


def test_ppo_core_wheel_runs_with_only_torch(wheels: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        python,
        "--find-links",
        cpu_torch_dir(),
        f"torch=={torch.__version__}",
        str(wheels["klppo-ppo-core"]),
    )
    listed = uv("pip", "list", "--python", python, "--format", "freeze").stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert {"klppo-ppo-core", "torch"} <= installed
    assert not {"numpy", "klppo-batching", "klppo-train", "transformers"} & installed, installed
    script = (
        "import torch, ppo_core\n"
        "r = torch.tensor([[0.0, 1.0]]); v = torch.zeros(1, 2); m = torch.ones(1, 2)\n"
        "adv, ret = ppo_core.compute_gae(r, v, m, gamma=1.0, lam=1.0)\n"
        "print(ret.tolist(), ppo_core.__version__)\n"
    )
    run = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # returns with γ=λ=1 and zero values are the reward-to-go: [1, 1]
    assert run.stdout.split() == ["[[1.0,", "1.0]]", version("klppo-ppo-core")]
