"""token_level_scores: a sequence's score on its last valid response token."""

import pytest
import torch

from ppo_core import token_level_scores


def test_scores_sit_on_the_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = token_level_scores([0.5, -1.0, 3.0, 2.0], mask)
    expected = torch.tensor(
        [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2.0]], dtype=torch.float32
    )
    assert torch.equal(out, expected)  # the all-padding row drops its score


def test_a_gap_in_the_mask_keeps_the_last_valid_token() -> None:
    # an observation token masked out inside a response: the score still goes to the end
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    assert token_level_scores(torch.tensor([7.0]), mask).tolist() == [[0, 0, 0, 7.0, 0]]


def test_shapes_are_checked() -> None:
    mask = torch.ones(4, 3)
    assert token_level_scores(torch.ones(4), mask[:, :0]).shape == (4, 0)
    with pytest.raises(ValueError, match=r"scores \(3,\) must be \[B\] = \[4\]"):
        token_level_scores([1.0, 2.0, 3.0], mask)
    with pytest.raises(ValueError, match=r"response_mask.*\[B, T\]"):
        token_level_scores([1.0], torch.ones(3))
