"""Packed attention for the trainer's HF models: ``batching.varlen_causal_attention``
registered with transformers' attention-function interface as ``"klppo_varlen"``.

Why: with transformers' ``sdpa``, a packed ``[1, nnz]`` row gets a dense block-diagonal
``[nnz, nnz]`` mask, so attention costs ``nnz²`` (slower than padding on CPU, and most of
the memory of a large micro-batch). ``klppo_varlen`` reads the flash-attn varlen kwargs
(``cu_seq_lens_q``, which :meth:`batching.Packing.model_kwargs` passes) and attends each
sequence to itself only, at a cost linear in Σ Lᵢ². The same kwargs drive
``flash_attention_2`` where flash-attn is installed on a GPU. A shared-prompt packing
(:func:`batching.pack_shared_prompts`) passes its ``packed_layout`` instead: only
``klppo_varlen`` can run it.

Calls that are not packed keep transformers' own ``sdpa`` behaviour: a 2-D padding mask is
turned into sdpa's mask as usual and attended with sdpa (the embedded warm-up, greedy
accuracy, HF generation all call the trainer's models that way).
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from batching import (
    VarlenLayout,
    cu_seqlens_from_positions,
    varlen_causal_attention,
    varlen_layout,
)
from klppo_train.config.choices import VARLEN
from klppo_train.runtime.sequence_parallel import ULYSSES

GROUP_ATTENTION = "klppo_group_attention"
"""An attention module's attribute: the :data:`batching.GroupAttention` its packed rows use
(set by ``model.compile``: :func:`batching.compiled_group_attention`); sdpa where absent."""

# The layout of the row being run: every layer of one forward gets the same cu_seqlens
# tensor, so it is computed once per forward (one host read of cu_seqlens).
_last_layout: tuple[torch.Tensor | None, VarlenLayout | None] = (None, None)


def _layout(cu_seqlens: torch.Tensor) -> VarlenLayout:
    global _last_layout
    if _last_layout[0] is not cu_seqlens:
        _last_layout = (cu_seqlens, varlen_layout(cu_seqlens))
    return _last_layout[1]


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, H, nnz, D]``, key/value
    ``[1, H_kv, nnz, D]`` → ``([1, nnz, H, D], None)``."""
    # A cache (key longer than query) or a batch of rows is not a packed row.
    split = kwargs.get(ULYSSES)  # a slice of a packed row: it may hold one token
    packed = query.shape[0] == 1 and key.shape[2] == query.shape[2]
    packed = packed and (query.shape[2] > 1 or split is not None)
    if attention_mask is not None or not packed:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layout = kwargs.get("packed_layout")  # a shared-prompt packing (batching.Packing.layout)
    if layout is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_from_positions(kwargs["position_ids"])
        layout = _layout(cu_seqlens)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [nnz, heads, D]
    if split is not None:  # this rank's slice of the row → whole sequences, 1/sp of the heads
        q, k, v = split.whole_sequences(q, k, v)
    out = varlen_causal_attention(
        q,
        k,
        v,
        layout,
        scale=scaling,
        dropout_p=dropout,
        group_attention=getattr(module, GROUP_ATTENTION, None),
    )
    if split is not None:
        out = split.back_to_slice(out)
    return out.unsqueeze(0), None


def _varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    # No 2-D mask = a packed (or unpadded) row: the attention above needs no mask at all,
    # so never build the [nnz, nnz] one. A padded batch gets sdpa's mask as usual.
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN, _varlen_mask)


def packed_attention_implementation(
    setting: str, device: torch.device, needs_varlen: bool = False
) -> str:
    """``model.attn_implementation``; ``auto`` = ``klppo_varlen`` when ``needs_varlen``
    (``model.share_prompts``, sequence parallelism: only it runs those), else
    ``flash_attention_2`` on CUDA where flash-attn is installed, else ``klppo_varlen``."""
    if setting != "auto":
        return setting
    if needs_varlen:
        return VARLEN
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN
