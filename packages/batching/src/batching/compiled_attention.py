"""A compiled group attention for short bf16 groups on CPU, sdpa for everything else.

:func:`varlen_causal_attention` attends one group of equal-length sequences at a time
through a :data:`GroupAttention`. On CPU, CPU sdpa's bf16 kernels are slow for short
sequences; ``torch.compile`` of :func:`matmul_causal_attention` (scores, fp32 softmax, one
fused kernel per step) runs them about 2x faster, forward and backward (SmolLM2 shapes, 2
threads). Pure torch: any model's attention can use it.
"""

from __future__ import annotations

import torch

from batching.attention import GroupAttention, matmul_causal_attention, sdpa_causal_attention

MATMUL_MAX_LEN = 256
"""Longest group (tokens) the compiled matmul attention takes; measured faster than sdpa up
to 220 tokens (SmolLM2 shapes, bf16, 2 CPU threads), its scores grow with L²."""

_compiled_matmul: GroupAttention | None = None


def compiled_group_attention() -> GroupAttention:
    """A bf16 group on CPU of 2 or more sequences of 2 to :data:`MATMUL_MAX_LEN` tokens goes
    through ``torch.compile(matmul_causal_attention)``, anything else through
    :func:`sdpa_causal_attention`. One compiled function for every caller (compiled once,
    dynamic shapes)."""
    global _compiled_matmul
    if _compiled_matmul is None:
        _compiled_matmul = torch.compile(matmul_causal_attention, dynamic=True)
    compiled = _compiled_matmul

    def attend(q, k, v, scale: float) -> torch.Tensor:
        # A group of one sequence, or of 1-token sequences, goes to sdpa: the compiler
        # specializes sizes 0 and 1, and such a group would recompile mid-run (seconds).
        short = q.shape[0] > 1 and 1 < q.shape[2] <= MATMUL_MAX_LEN
        if short and q.dtype == torch.bfloat16 and q.device.type == "cpu":
            return compiled(q, k, v, scale)
        return sdpa_causal_attention(q, k, v, scale)

    return attend
