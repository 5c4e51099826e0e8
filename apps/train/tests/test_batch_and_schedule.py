"""Rollout samples → trainer tensors; learning-rate schedules."""

import math

import pytest
import torch

from klppo_train.trainer.schedule import lr_factor, make_scheduler
from klppo_train.workers.trajectories import trajectories
from rollout import RolloutBatch, Sample

PAD = 0


def test_trajectories_layout() -> None:
    prompts = [[5, 6, 7], [8]]
    batch = RolloutBatch(
        [
            Sample(0, (9, 1), (-0.5, -0.25), "stop", 3),
            Sample(0, (10, 11, 12), (-1.0, -2.0, -3.0), "length", 3),
            Sample(1, (13,), (-0.75,), "stop", 3),
        ],
        3,
    )
    t = trajectories(prompts, batch, pad_token_id=PAD, response_length=4)
    assert t.input_ids.tolist() == [
        [5, 6, 7, 9, 1, PAD, PAD],
        [5, 6, 7, 10, 11, 12, PAD],
        [PAD, PAD, 8, 13, PAD, PAD, PAD],
    ]
    assert t.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 0, 0, 0],
    ]
    assert t.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert t.engine_logprobs[2].tolist() == [-0.75, 0.0, 0.0, 0.0]
    assert t.prompt_index.tolist() == [0, 0, 1] and t.policy_version == 3
    assert t.response_ids.tolist()[1] == [10, 11, 12, PAD]


def test_response_longer_than_the_width_is_refused() -> None:
    batch = RolloutBatch([Sample(0, (1, 2, 3), (0.0, 0.0, 0.0), "length", 0)], 0)
    with pytest.raises(ValueError, match="sample 0 has 3 tokens, more than width=2"):
        trajectories([[4]], batch, pad_token_id=PAD, response_length=2)


def test_lr_factors() -> None:
    # warm-up 4 steps: 1/4, 2/4, 3/4, 4/4; then cosine over the remaining 4 steps to 0
    factors = [lr_factor(s, warmup_steps=4, total_steps=8, kind="cosine") for s in range(9)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[6] == pytest.approx(0.5) and factors[8] == 0.0
    assert lr_factor(100, warmup_steps=0, total_steps=8, kind="constant") == 1.0
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        lr_factor(0, warmup_steps=0, total_steps=1, kind="linear")


def test_scheduler_drives_the_optimizer_and_checkpoints() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=6, kind="cosine")
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.1 * 0.5 * (1 + math.cos(math.pi / 4))])
    restored = make_scheduler(
        torch.optim.SGD([param], lr=0.1), warmup_steps=2, total_steps=6, kind="cosine"
    )
    restored.load_state_dict(sched.state_dict())
    assert restored.last_epoch == sched.last_epoch == 4
