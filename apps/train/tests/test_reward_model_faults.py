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

STEPS = 30  # ~0.1 s each: the signal (after step 2) lands well before the end


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
    args = [*rm_overrides(tmp_path, tiny_model, steps=STEPS), "trainer.test_freq=10"]
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


@pytest.mark.slow  # its own process, signalled
def test_a_ppo_run_preempted_while_training_its_reward_model_first_exits_143(
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
) -> None:
    """``reward_model.source``: the PPO run trains its missing reward model first, under the
    same loop; a SIGTERM then checkpoints that run and ends the command with 143, not a
    traceback."""
    from omegaconf import OmegaConf

    rm_run = tmp_path / "run"
    rm_recipe = tmp_path / "rm.yaml"
    dotlist = [*rm_overrides(tmp_path, tiny_model, steps=STEPS), "trainer.save_freq=0"]
    OmegaConf.save(OmegaConf.from_dotlist(dotlist), rm_recipe)
    ppo = [
        f"trainer.run_dir={tmp_path / 'ppo'}",
        "trainer.total_training_steps=2",
        "rollout.engine=hf",
        "reward_model.enable=true",
        f"reward_model.path={tmp_path / 'rm_hf'}",
        f"reward_model.source={rm_recipe}",
    ]
    log = tmp_path / "ppo.log"
    process = _launch(ppo, 1, log)
    wait_for_step(rm_run, 2, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "exit 143 (resume_mode=auto continues)" in text and "Traceback" not in text
    stopped = records(rm_run)[-1]["step"]
    assert (rm_run / f"checkpoints/global_step_{stopped}").is_dir()
    assert not (tmp_path / "rm_hf").exists()  # trained first, not yet exported
