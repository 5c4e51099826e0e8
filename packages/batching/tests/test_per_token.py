"""per_response_token: the value at the position before each response token, back in input
order, whatever the micro-batching (token budget or fixed sizes)."""

import pytest
import torch

from batching import Packing, per_response_token


def _batch():
    # 4 rows, P = 4 (left-padded prompts), T = 3 (right-padded responses); token = 10·row + col
    prompt = [4, 2, 3, 1]
    response = [3, 1, 2, 3]
    P, T = 4, 3
    ids = torch.tensor([[10 * r + c for c in range(P + T)] for r in range(4)])
    mask = torch.zeros(4, P + T, dtype=torch.long)
    for r, (p, n) in enumerate(zip(prompt, response, strict=True)):
        mask[r, P - p : P + n] = 1
    return ids, mask, P, T


def _token_at(model, packing: Packing, keep: torch.Tensor):
    # the packed token itself, and its position in the sequence: both must land at [b, j]
    return packing.input_ids[0, keep].float(), packing.position_ids[0, keep].float()


@pytest.mark.parametrize(
    "plan", [{"max_tokens": 100}, {"max_tokens": 8}, {"max_tokens": 0, "micro_batch_size": 3}]
)
def test_values_before_each_response_token_in_input_order(plan) -> None:
    ids, mask, P, T = _batch()
    tokens, positions = per_response_token(None, ids, mask, T, _token_at, **plan)
    assert tokens.shape == positions.shape == (4, T)
    response_mask = mask[:, P:].bool()
    # position P - 1 + j predicts response token j
    expected = ids[:, P - 1 : P - 1 + T].float()
    assert torch.equal(tokens[response_mask], expected[response_mask])
    prompt_len = mask[:, :P].sum(-1, keepdim=True)
    expected_pos = (prompt_len - 1 + torch.arange(T)).float()
    assert torch.equal(positions[response_mask], expected_pos[response_mask])


def test_run_micro_batch_is_one_planned_micro_batch_in_its_rows_order() -> None:
    from batching import run_micro_batch

    ids, mask, P, T = _batch()
    rows = torch.tensor([2, 0, 3])  # a micro-batch an update cut itself, in its own order
    tokens, positions = run_micro_batch(None, ids[rows], mask[rows], T, _token_at)
    want_tokens, want_positions = per_response_token(None, ids, mask, T, _token_at, max_tokens=100)
    response_mask = mask[rows, P:].bool()
    assert tokens.shape == (3, T)
    assert torch.equal(tokens[response_mask], want_tokens[rows][response_mask])
    assert torch.equal(positions[response_mask], want_positions[rows][response_mask])
