"""A reward-model run under the one run loop is preempted like a PPO run: SIGTERM → a
checkpoint at the step boundary and exit 143; ``resume_mode=auto`` continues to the same
metrics as the uninterrupted run. In one process and under torchrun at world size 2."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_reward_model import rm_overrides, tiny_model  # noqa: F401 (a fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from fault_runs import difference, records, wait_for_step  # noqa: E402

STEPS = 60  # ~0.1 s each: the signal lands well before the end


def _launch(args: list[str], nproc: int, log: Path) -> subprocess.Popen:
    torchrun = [
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
    ]  # fmt: skip
    command = [sys.executable, *(torchrun if nproc > 1 else []), "-m", "klppo_train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("a") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow  # three runs in their own processes (torchrun at world size 2)
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_sigtermed_reward_model_run_checkpoints_and_resumes_exactly(
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
    nproc: int,
) -> None:
    args = [*rm_overrides(tmp_path, tiny_model, steps=STEPS), "trainer.test_freq=20"]
    args += ["trainer.save_freq=0"]  # the only checkpoint before the end is the signal's
    run, log = tmp_path / "run", tmp_path / "run.log"
    first = _launch(args, nproc, log)
    wait_for_step(run, 2, first)
    first.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    assert first.wait(timeout=300) != 0
    text = log.read_text()
    assert text.count("exit 143 (resume_mode=auto continues)") == nproc, text[-3000:]
    if nproc == 1:
        assert first.returncode == 143
    stopped = records(run)[-1]["step"]
    assert 2 <= stopped < STEPS
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"global_step_{stopped}"]

    assert _launch(args, nproc, log).wait(timeout=300) == 0  # resume_mode=auto
    reference = [a.replace(str(run), str(tmp_path / "reference")) for a in args]
    assert _launch(reference, nproc, tmp_path / "ref.log").wait(timeout=300) == 0
    got = records(run)
    assert [r["step"] for r in got] == list(range(STEPS + 1))
    assert difference(got, records(tmp_path / "reference")) <= 1e-6
    assert (run / "reward_model_hf" / "config.json").is_file()
