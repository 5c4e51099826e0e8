"""compiled_group_attention: which groups take the compiled matmul path, and that its
numbers are the attention's."""

import torch

from batching import (
    MATMUL_MAX_LEN,
    compiled_group_attention,
    matmul_causal_attention,
    sdpa_causal_attention,
)


def qkv(groups: int, length: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(groups, 6, length, 16), (groups, 2, length, 16), (groups, 2, length, 16)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def test_short_bf16_groups_take_the_compiled_matmul_and_keep_the_numbers() -> None:
    attend = compiled_group_attention()
    q, k, v = (t.requires_grad_() for t in qkv(3, 40, torch.bfloat16))
    got = attend(q, k, v, 0.25)
    exact = matmul_causal_attention(*(t.detach().double() for t in (q, k, v)), 0.25)
    torch.testing.assert_close(got.double(), exact, atol=0.03, rtol=0)
    assert not torch.equal(got, sdpa_causal_attention(q, k, v, 0.25).to(got.dtype))
    got.sum().backward()  # the compiled backward
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_long_fp32_or_size_one_groups_stay_with_sdpa() -> None:
    attend = compiled_group_attention()
    cases = [(2, MATMUL_MAX_LEN + 1, torch.bfloat16), (2, 40, torch.float32)]
    cases += [(1, 40, torch.bfloat16), (3, 1, torch.bfloat16)]  # sizes the compiler specializes
    for groups, length, dtype in cases:
        q, k, v = qkv(groups, length, dtype)
        assert torch.equal(attend(q, k, v, 0.25), sdpa_causal_attention(q, k, v, 0.25))
