"""GAE, GRPO, RLOO and REINFORCE++ advantages with hand-derived values."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_core import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    masked_whiten,
)

D = torch.float64


def gae_raw(rewards, values, mask, gamma, lam):
    # returns = A + V, so the un-whitened advantages are returns − V.
    _, returns = compute_gae(rewards, values, mask, gamma, lam)
    return returns - values


def test_gae_hand_values() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=D)
    v = torch.full((2, 3), 0.5, dtype=D)
    # row 0 fully valid, row 1 with an observation token at t = 1. γ = 0.9, λ = 0.8:
    # row 0: δ2 = 1 − 0.5 = 0.5, A2 = 0.5
    #        δ1 = 0.9·0.5 − 0.5 = −0.05, A1 = −0.05 + 0.72·0.5 = 0.31
    #        δ0 = −0.05, A0 = −0.05 + 0.72·0.31 = 0.1732
    # row 1: t = 1 is skipped (A and next-V carry over), so A0 = −0.05 + 0.72·0.5 = 0.31
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    advantages, returns = compute_gae(r, v, mask, gamma=0.9, lam=0.8)
    raw = torch.tensor([[0.1732, 0.31, 0.5], [0.31, 0.5, 0.5]], dtype=D)
    torch.testing.assert_close(returns, raw + 0.5)
    torch.testing.assert_close(advantages, masked_whiten(raw, mask))


def test_gae_trailing_padding_does_not_leak() -> None:
    # A reward placed on a padding position must not reach the valid tokens.
    r = torch.tensor([[0.0, 1.0, 5.0]], dtype=D)
    v = torch.zeros(1, 3, dtype=D)
    raw = gae_raw(r, v, torch.tensor([[1, 1, 0]]), gamma=1.0, lam=1.0)
    assert raw[0, :2].tolist() == [1.0, 1.0]


def test_grpo_hand_values() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0], [1, 1]])
    # group a = [1, 0, 1, 1]: mean 0.75, unbiased var (3·0.0625 + 0.5625) / 3 = 0.25, std 0.5
    # group b = [5] alone: mean 0, std 1
    adv, ret = compute_grpo_advantages(scores, ["a", "a", "a", "a", "b"], mask)
    # row 3 is all-masked, so its tokens are 0 whatever its advantage
    per_seq = torch.tensor([0.25 / 0.500001, -0.75 / 0.500001, 0.25 / 0.500001, 0.0, 5 / 1.000001])
    torch.testing.assert_close(adv[:, 0], per_seq.to(D))
    torch.testing.assert_close(adv * 1.0, adv * mask)  # masked tokens are 0
    assert ret is adv
    by_tensor, _ = compute_grpo_advantages(scores, torch.tensor([7, 7, 7, 7, 3]), mask)
    torch.testing.assert_close(by_tensor, adv)


def test_grpo_without_std() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0], dtype=D)
    adv, _ = compute_grpo_advantages(scores, [0, 0, 0, 0, 1], torch.ones(5, 1), norm_by_std=False)
    assert adv[:, 0].tolist() == [0.25, -0.75, 0.25, 0.25, 5.0]


def test_rloo_hand_values() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0], dtype=D)
    # group a: sum 3, n 4: 1 − (3 − 1)/3 = 1/3, 0 − 3/3 = −1; group b alone keeps 5
    adv, _ = compute_rloo_advantages(scores, [0, 0, 0, 0, 1], torch.ones(5, 2))
    torch.testing.assert_close(adv[:, 1], torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3, 5.0], dtype=D))


def test_group_ids_must_match_batch() -> None:
    with pytest.raises(ValueError, match="`group_ids` has 2 entries but `scores` has 3"):
        compute_grpo_advantages(torch.zeros(3), ["a", "b"], torch.ones(3, 2))
    with pytest.raises(ValueError, match="`response_mask` has shape"):
        compute_rloo_advantages(torch.zeros(3), [0, 0, 1], torch.ones(2, 2))


def test_reinforce_pp_hand_values() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # row 0, γ = 0.5: G = [0.25, 0.5, 1]
    # row 1: G2 = 1, reset by m2 = 1 → keeps 1; G1 = 0 + 0.5·1 = 0.5, then × m1 = 0 → 0;
    #        G0 = 1 + 0.5·0 = 1
    adv, returns = compute_reinforce_pp_advantages(r, mask, gamma=0.5)
    want = torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.5, 1.0]], dtype=D)
    torch.testing.assert_close(returns, want)
    torch.testing.assert_close(adv, masked_whiten(want, mask) * mask)


def test_advantage_shape_errors() -> None:
    with pytest.raises(ValueError, match="`values` has shape"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"`token_rewards` must have shape \[B, T\]"):
        compute_reinforce_pp_advantages(torch.zeros(3), torch.ones(3), 1.0)


@pytest.mark.slow  # two processes
def test_whitening_over_data_parallel_ranks_equals_the_whole_batch(tmp_path) -> None:
    worker = Path(__file__).with_name("dp_whiten_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    run = subprocess.run(
        [*cmd, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["gae"] < 1e-12 and result["reinforce_pp"] < 1e-12, result
        # whitening each rank's slice alone (the old behaviour) is measurably different
        assert result["gae_per_rank"] > 1e-2 and result["reinforce_pp_per_rank"] > 1e-2, result
