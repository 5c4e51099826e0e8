"""Varlen causal attention: against a per-token reference loop, gradients, grouping, cost."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import (
    group_by_length,
    matmul_causal_attention,
    pack,
    varlen_causal_attention,
    varlen_layout,
)


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def reference(q, k, v, lens, scale):
    """softmax(scale · q_i K[:i+1]ᵀ) V[:i+1] per sequence, token by token, head by head."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for n in lens:
        for i in range(start, start + n):
            for h in range(q.shape[1]):
                keys, values = k[start : i + 1, h // group], v[start : i + 1, h // group]
                out[i, h] = torch.softmax(scale * keys @ q[i, h], -1) @ values
        start += n
    return out


def qkv(nnz: int, heads: int, kv_heads: int, dim: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = [(nnz, heads, dim), (nnz, kv_heads, dim), (nnz, kv_heads, dim)]
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def test_group_by_length_by_hand():
    # longest first; a group spans at most 1.25x: 10,9,8 | 7,6 | 4 ; the empty row is dropped
    assert group_by_length([8, 4, 10, 0, 7, 9, 6], 1.25) == [[2, 5, 0], [4, 6], [1]]
    assert group_by_length([3, 3, 3], 1.0) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="ratio"):
        group_by_length([1], 0.5)


def test_layout_by_hand():
    layout = varlen_layout(cu_seqlens([2, 3, 0, 1]), ratio=2.0)
    # groups: [seq 1 (3 tokens), seq 0 (2)] then [seq 3 (1)]
    assert [g.gather.tolist() for g in layout.groups] == [[[2, 3, 4], [0, 1, 0]], [[5]]]
    # valid slots of [G * L]: all 3 of seq 1, the first 2 of seq 0 (slot 5 is padding)
    assert [g.valid_slots.tolist() for g in layout.groups] == [[0, 1, 2, 3, 4], [0]]
    # group-order rows: tokens 2,3,4,0,1,5 -> packed token t sits at row inverse[t]
    assert layout.inverse.tolist() == [3, 4, 0, 1, 2, 5]
    assert layout.nnz == 6


GROUP_ATTENTIONS = pytest.mark.parametrize(
    "group_attention", [None, matmul_causal_attention], ids=["sdpa", "matmul"]
)


@GROUP_ATTENTIONS
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("ratio", [1.0, 1.25, 100.0])
def test_matches_the_reference_loop(heads, kv_heads, ratio, group_attention):
    lens = [5, 3, 0, 7, 1, 6, 6, 2]
    q, k, v = qkv(sum(lens), heads, kv_heads, 8)
    layout = varlen_layout(cu_seqlens(lens), ratio)
    got = varlen_causal_attention(q, k, v, layout, scale=0.3, group_attention=group_attention)
    torch.testing.assert_close(got, reference(q, k, v, lens, 0.3), atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(0, 10_000))
def test_random_lengths_match_the_reference(lens, seed):
    q, k, v = qkv(sum(lens), 4, 2, 4, seed)
    got = varlen_causal_attention(q, k, v, varlen_layout(cu_seqlens(lens)))
    want = reference(q, k, v, lens, 1 / math.sqrt(4))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@GROUP_ATTENTIONS
def test_gradients_match_the_reference_loop(group_attention):
    lens = [4, 1, 6, 5, 6]
    inputs = qkv(sum(lens), 4, 2, 8)
    copies = [t.clone().requires_grad_() for t in inputs]
    for t in inputs:
        t.requires_grad_()
    weights = torch.randn(sum(lens), 4, 8, dtype=torch.float64)
    layout = varlen_layout(cu_seqlens(lens))
    out = varlen_causal_attention(*inputs, layout, group_attention=group_attention)
    (out * weights).sum().backward()
    (reference(*copies, lens, 1 / math.sqrt(8)) * weights).sum().backward()
    for a, b in zip(inputs, copies, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=0)


def test_sequences_never_see_each_other():
    lens = [3, 4]
    q, k, v = qkv(7, 2, 2, 4)
    layout = varlen_layout(cu_seqlens(lens))
    before = varlen_causal_attention(q, k, v, layout)
    k2, v2 = k.clone(), v.clone()
    k2[3:], v2[3:] = 100.0, -100.0  # change every key/value of the second sequence
    after = varlen_causal_attention(q, k2, v2, layout)
    torch.testing.assert_close(after[:3], before[:3], atol=0, rtol=0)
    assert not torch.allclose(after[3:], before[3:])


def test_attention_work_is_linear_in_the_sequences_not_the_row():
    """Σ over groups of G·L_max² stays within ratio² of Σ Lᵢ², at any number of sequences
    (a dense block-diagonal mask costs nnz², which grows with the square of the count)."""
    g = torch.Generator().manual_seed(0)
    for count in (8, 64, 512):
        lens = torch.randint(40, 71, (count,), generator=g).tolist()
        layout = varlen_layout(cu_seqlens(lens), ratio=1.25)
        work = sum(grp.gather.shape[0] * grp.gather.shape[1] ** 2 for grp in layout.groups)
        assert work <= 1.25**2 * sum(n * n for n in lens)
        assert len(layout.groups) <= 3  # 40..70 spans 1.75x: ceil(log 1.75 / log 1.25)


def test_packed_row_layout_from_pack():
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    p = pack(ids, mask)
    layout = varlen_layout(p.cu_seqlens)
    assert [g.gather.tolist() for g in layout.groups] == [[[0, 1, 2]], [[3, 4]]]


def test_bfloat16_runs_and_is_close():
    lens = [9, 7, 3]
    q, k, v = qkv(sum(lens), 4, 2, 16)
    want = varlen_causal_attention(q, k, v, varlen_layout(cu_seqlens(lens)))
    got = varlen_causal_attention(
        *(t.bfloat16() for t in (q, k, v)), varlen_layout(cu_seqlens(lens))
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0)


def test_wrong_token_count_is_rejected():
    q, k, v = qkv(5, 2, 2, 4)
    with pytest.raises(ValueError, match="tokens"):
        varlen_causal_attention(q, k, v, varlen_layout(cu_seqlens([2, 2])))


def test_group_attention_is_what_runs_and_dropout_keeps_sdpa():
    lens = [3, 5]
    q, k, v = qkv(8, 2, 2, 4)
    layout = varlen_layout(cu_seqlens(lens))

    def zeros(q, k, v, scale):
        return torch.zeros_like(q)

    assert varlen_causal_attention(q, k, v, layout, group_attention=zeros).abs().sum() == 0
    torch.manual_seed(0)
    got = varlen_causal_attention(q, k, v, layout, dropout_p=0.5, group_attention=zeros)
    torch.manual_seed(0)
    want = varlen_causal_attention(q, k, v, layout, dropout_p=0.5)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got.abs().sum() > 0


def test_matmul_group_attention_in_bfloat16_is_close_to_float64():
    lens = [40, 33, 37]
    q, k, v = qkv(sum(lens), 6, 2, 64, seed=3)
    layout = varlen_layout(cu_seqlens(lens))
    want = varlen_causal_attention(q, k, v, layout)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    got = varlen_causal_attention(*bf16, layout, group_attention=matmul_causal_attention)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0)
