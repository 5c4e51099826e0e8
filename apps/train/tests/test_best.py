"""The best validation step's model kept (``trainer.best_metric``, ``best_greater_is_better``,
``export_best``): the tracker's rules, the metric ``auto`` picks, bad names refused before any
model loads, checkpoint pruning that keeps the best step's, and real runs whose
``actor_hf_best`` loads with transformers and re-validates to the summary's value."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_run import overrides, read_records
from transformers import AutoModelForCausalLM

from klppo_train.__main__ import main
from klppo_train.checks.preflight import validation_metrics
from klppo_train.config.errors import UserError
from klppo_train.data.rewards import RewardManager
from klppo_train.loop.best import BestStep, greater_is_better
from klppo_train.loop.checkpoints import complete_checkpoints, save_checkpoint_dir

ACC = "val/arithmetic/acc"


def test_the_tracker_keeps_the_first_best_and_its_state() -> None:
    best = BestStep(ACC, greater=True)
    seen = [(0, 0.2), (1, 0.5), (2, 0.5), (3, 0.4)]
    assert [best.improves(step, {ACC: v, "val/other": 9.0}) for step, v in seen] == [
        True, True, False, False,
    ]  # fmt: skip
    assert (best.step, best.value) == (1, 0.5)  # a tie keeps the earlier step
    lower = BestStep("val/rm/margin", greater=False)
    assert [lower.improves(s, {"val/rm/margin": v}) for s, v in seen] == [True, False, False, False]
    resumed = BestStep(ACC, greater=True)
    resumed.load_state_dict(best.state_dict())
    assert (resumed.step, resumed.value) == (1, 0.5)
    other = BestStep("val/reward_model/score", greater=True)
    other.load_state_dict(best.state_dict())  # another metric than the checkpoint's: afresh
    assert other.step is None
    with pytest.raises(UserError, match=r"trainer.best_metric='val/arithmetic/acc' .*\(val/x\)"):
        BestStep(ACC, greater=True).improves(1, {"val/x": 1.0})


def test_greater_is_better_follows_hf_unless_set() -> None:
    assert greater_is_better(ACC, None) and not greater_is_better("val/sft/loss", None)
    assert not greater_is_better(ACC, False) and greater_is_better("val/sft/loss", True)


@dataclass
class _Item:
    data_source: str


class _Val:  # what validation_metrics reads of a PromptDataset
    def __init__(self, *sources: str) -> None:
        self.items = [_Item(s) for s in sources]

    def __len__(self) -> int:
        return len(self.items)


def test_auto_takes_the_first_ruled_source_else_the_reward_model() -> None:
    rules = RewardManager()
    found = validation_metrics(_Val("mine", "gsm8k", "arithmetic", "gsm8k"), rules, True)
    assert found == ["val/gsm8k/acc", "val/arithmetic/acc", "val/reward_model/score"]
    assert validation_metrics(_Val("mine"), rules, True) == ["val/reward_model/score"]
    assert validation_metrics(_Val("mine"), rules, False) == []
    assert validation_metrics(_Val(), rules, True) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["trainer.best_metric=accuracy"], "trainer.best_metric='accuracy': 'auto' or a val"),
        (["trainer.best_metric=val/gsm8k/acc"], "validation reports val/arithmetic/acc\n"),
        (["trainer.best_metric=val/arithmetic/acc", "trainer.test_freq=0"], "test_freq is 0"),
    ],
)
def test_a_bad_best_metric_fails_before_any_model(tmp_path: Path, capsys, extra, message) -> None:
    assert main([*overrides(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "model").exists()  # no model was built


class _FileTrainee:
    """A trainee whose checkpoint is one file (pruning is what is under test)."""

    name = "actor"

    def save(self, path: Path, extra_state: dict | None = None) -> None:
        path.mkdir(parents=True)
        (path / "state.json").write_text(json.dumps(extra_state or {}))


def test_pruning_never_deletes_the_best_steps_checkpoint(tmp_path: Path) -> None:
    trainee = [_FileTrainee()]
    for step in range(1, 6):
        save_checkpoint_dir(tmp_path, trainee, {}, step, keep=2, protect=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4, 5]
    save_checkpoint_dir(tmp_path, trainee, {}, 6, keep=2, protect=5)  # a new best
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [5, 6]
    save_checkpoint_dir(tmp_path, trainee, {}, 7, keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 7]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_the_best_policy_is_exported_kept_over_a_resume_and_revalidates(tmp_path: Path) -> None:
    """4 steps validated at each, the best (here: the lowest accuracy, best_greater_is_better
    =false, so that it is not the last step) exported as actor_hf_best; stopped at step 2 and
    resumed, the same best; trainer.val_only on actor_hf_best gives the summary's value."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*overrides(straight, steps=4), "trainer.best_greater_is_better=false"]
    assert main(common) == 0
    values = {r["step"]: r[ACC] for r in read_records(straight)}
    step = min(values, key=lambda s: (values[s], s))
    best = _summary(straight)["best"]
    assert best == {"metric": ACC, "step": step, "value": values[step], "export": "actor_hf_best"}
    # The first of equal values is kept (a tie does not improve), so the best is not the
    # final policy unless step 4 alone is the lowest; these 4-step runs barely move the
    # accuracy (all equal on some CPUs), which keeps step 0's policy: another one either way.
    assert step != 4 and values[step] <= values[4]
    final = load_file(straight / "actor_hf" / "model.safetensors")
    kept = load_file(straight / "actor_hf_best" / "model.safetensors")
    assert any(not torch.equal(final[name], kept[name]) for name in final)
    again = [*overrides(resumed, steps=4), "trainer.best_greater_is_better=false"]
    assert main([*again, "trainer.stop_at_step=2", "trainer.save_freq=2"]) == 0
    assert main([*again, "trainer.save_freq=2"]) == 0
    assert _summary(resumed)["best"] == best
    exported = straight / "actor_hf_best"
    AutoModelForCausalLM.from_pretrained(exported)  # loads with transformers
    assert main([*common, "trainer.val_only=true", f"model.path={exported}"]) == 0
    assert _summary(straight / "val_only")[f"final_{ACC}"] == best["value"]


def test_by_default_the_highest_value_is_kept_and_export_best_false_keeps_none(
    tmp_path: Path,
) -> None:
    run, off = tmp_path / "run", tmp_path / "off"
    assert main(overrides(run, steps=2)) == 0
    values = {r["step"]: r[ACC] for r in read_records(run)}
    step = max(values, key=lambda s: (values[s], -s))
    assert _summary(run)["best"] == {
        "metric": ACC, "step": step, "value": values[step], "export": "actor_hf_best"
    }  # fmt: skip
    assert (run / "actor_hf_best" / "config.json").is_file()
    assert main([*overrides(off, steps=2), "trainer.export_best=false"]) == 0
    assert (off / "actor_hf").is_dir() and not (off / "actor_hf_best").exists()
    assert "best" not in _summary(off)
