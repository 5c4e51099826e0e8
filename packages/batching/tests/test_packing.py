"""Sequence packing: hand-written layouts, round trips, and packed-vs-padded model forwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from batching.packing import (
    Packing,
    block_causal_mask,
    next_token_labels,
    pack,
    pack_values,
    unpack,
)

# Row 0: left+right padding, row 1: right, row 2: empty, row 3: left.
IDS = torch.tensor(
    [
        [0, 0, 11, 12, 13, 0],
        [21, 22, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 41, 42, 43],
    ]
)
MASK = torch.tensor(
    [
        [0, 0, 1, 1, 1, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
    ]
)


# ---------------------------------------------------------------- hand-written layout


def test_pack_small_example_by_hand():
    p = pack(IDS, MASK)
    assert p.input_ids.tolist() == [[11, 12, 13, 21, 22, 41, 42, 43]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 5, 8]
    assert p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 3
    # flat index = row * 6 + column
    assert p.indices.tolist() == [2, 3, 4, 6, 7, 21, 22, 23]
    assert p.indices.dtype == torch.int64
    assert (p.batch_size, p.seq_len, p.nnz) == (4, 6, 8)
    assert p.seq_lens.tolist() == [3, 2, 0, 3]
    assert p.row_ids.tolist() == [0, 0, 0, 1, 1, 3, 3, 3]


@pytest.mark.parametrize(
    ("mask_row", "ids_row", "positions", "indices"),
    [
        ([0, 0, 1, 1], [0, 0, 7, 8], [0, 1], [2, 3]),  # left padding
        ([1, 1, 1, 0], [5, 6, 7, 0], [0, 1, 2], [0, 1, 2]),  # right padding
        ([0, 1, 1, 0], [0, 5, 6, 0], [0, 1], [1, 2]),  # both
        ([1, 0, 1, 1], [5, 0, 6, 7], [0, 1, 2], [0, 2, 3]),  # a hole: valid tokens in order
        ([1, 1, 1, 1], [5, 6, 7, 8], [0, 1, 2, 3], [0, 1, 2, 3]),  # no padding
        ([0, 0, 0, 0], [0, 0, 0, 0], [], []),  # zero-length row
    ],
)
def test_pack_single_row_layouts(mask_row, ids_row, positions, indices):
    p = pack(torch.tensor([ids_row]), torch.tensor([mask_row]))
    assert p.position_ids.tolist() == [positions]
    assert p.indices.tolist() == indices
    assert p.input_ids.tolist() == [[ids_row[i] for i in indices]]
    assert p.cu_seqlens.tolist() == [0, len(indices)]
    assert p.max_seqlen == len(indices)


def test_pack_accepts_bool_and_float_masks():
    reference = pack(IDS, MASK)
    for mask in (MASK.bool(), MASK.float()):
        p = pack(IDS, mask)
        assert torch.equal(p.input_ids, reference.input_ids)
        assert torch.equal(p.position_ids, reference.position_ids)
        assert torch.equal(p.cu_seqlens, reference.cu_seqlens)


def test_all_rows_empty():
    p = pack(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4))
    assert p.nnz == 0 and p.max_seqlen == 0
    assert p.cu_seqlens.tolist() == [0, 0, 0, 0]
    out = unpack(torch.zeros(1, 0, 5), p, pad_value=-1.0)
    assert out.shape == (3, 4, 5) and (out == -1).all()


def test_next_token_labels_by_hand():
    labels, valid = next_token_labels(pack(IDS, MASK))
    assert labels.tolist() == [[12, 13, 21, 22, 41, 42, 43, 11]]
    # False at each sequence's last token: the next packed token belongs to another row.
    assert valid.tolist() == [[True, True, False, True, False, True, True, False]]


def test_block_causal_mask_by_hand():
    p = pack(torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    mask = block_causal_mask(p)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == expected


def test_model_kwargs_select_the_packed_path():
    p = pack(IDS, MASK)
    kwargs = p.model_kwargs()
    assert kwargs["input_ids"] is p.input_ids
    assert kwargs["position_ids"] is p.position_ids
    assert kwargs["attention_mask"] is None
    assert kwargs["use_cache"] is False


def test_packing_is_frozen():
    p = pack(IDS, MASK)
    with pytest.raises(AttributeError):
        p.max_seqlen = 7  # type: ignore[misc]
    assert isinstance(p.to("cpu"), Packing)


# ---------------------------------------------------------------- round trips, gradients


def test_pack_unpack_round_trip_with_trailing_dims():
    values = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    p = pack(IDS, MASK)
    packed = pack_values(values, p)
    assert packed.shape == (1, 8, 3)
    for as_batched in (packed, packed[0]):
        out = unpack(as_batched, p, pad_value=-5.0)
        assert out.shape == (4, 6, 3)
        expected = torch.where(MASK.bool()[..., None], values, torch.tensor(-5.0))
        assert torch.equal(out, expected)


def test_unpack_input_ids_gives_back_the_batch():
    p = pack(IDS, MASK)
    assert torch.equal(unpack(p.input_ids, p), IDS * MASK)
    assert unpack(p.input_ids, p).dtype == IDS.dtype


def test_unpack_one_token_packing_reads_leading_one_as_batch_dim():
    p = pack(torch.tensor([[0, 9]]), torch.tensor([[0, 1]]))
    assert unpack(torch.tensor([[3.0]]), p).tolist() == [[0.0, 3.0]]


def test_gradient_flows_through_unpack():
    p = pack(IDS, MASK)
    packed = torch.randn(1, p.nnz, requires_grad=True)
    weights = torch.randn(4, 6)
    (unpack(packed, p, pad_value=100.0) * weights).sum().backward()
    # Each packed value receives the weight of the slot it lands in; padding sends nothing.
    assert torch.equal(packed.grad, pack_values(weights, p))


def test_gradient_flows_through_pack_values():
    values = torch.randn(4, 6, requires_grad=True)
    p = pack(IDS, MASK)
    pack_values(values, p).sum().backward()
    assert torch.equal(values.grad, MASK.float())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_round_trip_on_random_masks(data):
    rows = data.draw(st.integers(1, 5))
    cols = data.draw(st.integers(1, 7))
    bits = data.draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    mask = torch.tensor(bits).reshape(rows, cols)
    ids = torch.arange(1, rows * cols + 1).reshape(rows, cols)
    p = pack(ids, mask)
    assert torch.equal(unpack(p.input_ids, p, pad_value=-1), torch.where(mask, ids, -1))
    assert p.cu_seqlens[-1].item() == p.nnz == int(mask.sum())
    # Positions restart at 0 for every non-empty sequence and count up by one.
    for b in range(rows):
        start, end = p.cu_seqlens[b].item(), p.cu_seqlens[b + 1].item()
        assert p.position_ids[0, start:end].tolist() == list(range(end - start))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("ids", "mask", "argument"),
    [
        (torch.zeros(6, dtype=torch.long), torch.ones(6), "input_ids"),
        (torch.zeros(2, 3), torch.ones(2, 3), "input_ids"),
        (torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3), "input_ids"),
        (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), "attention_mask"),
        (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 2), "attention_mask"),
        (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 0.5), "attention_mask"),
    ],
)
def test_pack_rejects_bad_input(ids, mask, argument):
    with pytest.raises(ValueError, match=argument):
        pack(ids, mask)


def test_unpack_rejects_wrong_length():
    p = pack(IDS, MASK)
    with pytest.raises(ValueError, match=r"packed_values.*nnz = 8.*\(1, 7\)"):
        unpack(torch.zeros(1, 7), p)
    with pytest.raises(ValueError, match="packed_values"):
        unpack(torch.zeros(9, 2), p)


def test_pack_values_rejects_wrong_shape():
    p = pack(IDS, MASK)
    with pytest.raises(ValueError, match=r"values.*\[4, 6, \.\.\.\].*\(6, 4\)"):
        pack_values(torch.zeros(6, 4), p)


# ---------------------------------------------------------------- packed == padded forward

# Mixed layouts: left-padded prompt + right-padded response, pure left, pure right, full,
# and an empty row; lengths 7, 5, 9, 12, 0.
EQ_MASK = torch.tensor(
    [
        [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
)
VOCAB = 100


def _tiny_model(config_cls):
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module", params=[Qwen2Config, LlamaConfig], ids=["qwen2", "llama"])
def model(request):
    return _tiny_model(request.param)


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, EQ_MASK.shape, generator=generator) * EQ_MASK
    return ids, EQ_MASK


def _next_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits, ``[...]`` labels -> ``[...]`` log p(label)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)


@torch.no_grad()
def _padded_logprobs(model, ids, mask):
    """``[B, S-1]`` log p(ids[:, t+1]) from the padded forward, as HF generation lays it out."""
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).logits
    return _next_token_logprobs(logits[:, :-1], ids[:, 1:])


@torch.no_grad()
def _packed_logprobs(model, packing, **forward_kwargs):
    """``[B, S-1]`` the same quantity from one packed forward, unpacked."""
    logits = model(**forward_kwargs).logits
    labels, _ = next_token_labels(packing)
    return unpack(_next_token_logprobs(logits, labels), packing)[:, :-1]


def _compared_positions(mask):
    # A valid token whose next token is valid and in the same row.
    return mask[:, :-1].bool() & mask[:, 1:].bool()


def test_next_token_valid_matches_padded_pairs(batch):
    ids, mask = batch
    p = pack(ids, mask)
    _, valid = next_token_labels(p)
    assert torch.equal(unpack(valid, p)[:, :-1], _compared_positions(mask))


def test_packed_forward_equals_padded_forward(model, batch):
    ids, mask = batch
    p = pack(ids, mask)
    padded = _padded_logprobs(model, ids, mask)
    packed = _packed_logprobs(model, p, **p.model_kwargs())
    where = _compared_positions(mask)
    assert where.sum() == 7 + 5 + 9 + 12 - 4  # one fewer pair than tokens per non-empty row
    torch.testing.assert_close(packed[where], padded[where], atol=1e-5, rtol=0)


def test_explicit_block_causal_mask_with_sdpa_equals_padded_forward(model, batch):
    ids, mask = batch
    p = pack(ids, mask)
    padded = _padded_logprobs(model, ids, mask)
    packed = _packed_logprobs(
        model,
        p,
        input_ids=p.input_ids,
        position_ids=p.position_ids,
        attention_mask=block_causal_mask(p),
        use_cache=False,
    )
    where = _compared_positions(mask)
    torch.testing.assert_close(packed[where], padded[where], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "mistake",
    ["positions_do_not_restart", "cache_left_on", "all_ones_mask"],
)
def test_wrong_packed_forward_does_not_match(model, batch, mistake):
    ids, mask = batch
    p = pack(ids, mask)
    kwargs = p.model_kwargs()
    if mistake == "positions_do_not_restart":
        kwargs["position_ids"] = torch.arange(p.nnz)[None]
    elif mistake == "cache_left_on":
        # config.use_cache is True: HF then builds a cache and skips packing detection.
        del kwargs["use_cache"]
    else:
        kwargs["attention_mask"] = torch.ones_like(p.input_ids)
    padded = _padded_logprobs(model, ids, mask)
    packed = _packed_logprobs(model, p, **kwargs)
    where = _compared_positions(mask)
    # Seen: ~0.2-0.3; the first sequence alone is still right, so only the maximum is large.
    assert (packed[where] - padded[where]).abs().max() > 1e-2


def test_cu_seqlens_from_positions_finds_each_sequence_and_refuses_shared_prompts() -> None:
    from batching import cu_seqlens_from_positions

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert cu_seqlens_from_positions(positions).tolist() == [0, 3, 5, 9]
    assert cu_seqlens_from_positions(positions).dtype == torch.int32
    # a sample that continues its shared prompt's positions (3, 4 after 0, 1, 2) starts at 3
    with pytest.raises(ValueError, match="start at position 0"):
        cu_seqlens_from_positions(torch.tensor([[0, 1, 2, 3, 4, 3, 4]]))
