"""Checkpoint round trip across process groups, crash safety, HF export and offload (2 ranks)."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import torchrun
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_save_resume_export(strategy: str, tmp_path: Path) -> None:
    torchrun("ckpt_worker.py", "save", strategy, str(tmp_path))
    torchrun("ckpt_worker.py", "resume", strategy, str(tmp_path))  # a fresh process group
    saved = json.loads((tmp_path / "save.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    # step 3 after loading the step-2 checkpoint equals the uninterrupted step 3 exactly
    assert resumed["loss3"] == saved["losses"][2]
    assert resumed["extra"] == {"step": 2, "kl_coef": 0.1}
    # the crashed save left its temp dir, never touched the checkpoint; the next save cleaned up
    assert resumed["crashed"] and len(resumed["stale_after_crash"]) == 1
    assert resumed["tmp_left_after_next_save"] == []
    assert saved["offloaded"] == ["cpu"]
    # the HF export loads into a plain HF model with exactly the trained weights
    final = torch.load(tmp_path / "final.pt")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = dict(exported.named_parameters())
    assert sorted(state) == sorted(final)
    for name, tensor in final.items():
        assert torch.equal(state[name].detach(), tensor), name
