"""Sequence packing ("remove padding"): run a padded batch as one row of valid tokens.

A PPO batch is ``[B, S]`` with a 0/1 ``attention_mask`` (left-padded prompt followed
by a right-padded response is the usual RL layout; plain left or right padding works
too). Padding can be most of the tensor, and the model spends FLOPs on every slot.
:func:`pack` drops the padding: the valid tokens of all rows, row after row, become one
``[1, nnz]`` row, with ``position_ids`` restarting at 0 for each sequence and the
flash-attn varlen metadata (``cu_seqlens``, ``max_seqlen``). :func:`unpack` scatters any
per-token output (logits, log-probs, values) back to ``[B, S, ...]``.

Which attention path makes a packed forward equal the padded one (CPU, transformers 5.24)
-----------------------------------------------------------------------------------------
The packed row must not let one sequence attend to another, and each sequence must get
rotary positions 0..L-1. Measured on tiny fp32 Qwen2 and Llama models against the padded
forward (``attention_mask`` plus ``position_ids = cumsum(mask) - 1``, what HF generation
uses for left padding), max abs difference of next-token log-probs:

* Exact but quadratic: HF's own packed-sequence detection (the dense mask costs ``nnz²``
  time and memory, slower than padding on CPU; the faster, linear path is
  :func:`batching.varlen_causal_attention`, see ``batching/attention.py``). Call::

      model(**packing.model_kwargs())
      # == model(input_ids=packing.input_ids, position_ids=packing.position_ids,
      #          attention_mask=None, use_cache=False)

  With a 2-D mask of ``None`` and no cache, ``masking_utils.create_causal_mask`` sees the
  restarting ``position_ids`` and builds a block-diagonal causal mask for ``sdpa``
  (≈5e-7), ``eager`` (≤5e-7) and ``flex_attention`` (0; slow first call, it compiles).
  Under ``flash_attention_2`` HF detects packing from the same ``position_ids`` (or
  takes ``cu_seqlens``/``max_seqlen`` as ``cu_seq_lens_q/k``, ``max_length_q/k``); that
  path needs a GPU and was not measured here.
* ``use_cache=False`` is required. ``config.use_cache`` defaults to True, and in eval
  *and* train mode the model then creates a ``DynamicCache``, which switches the packing
  detection off: plain causal attention across sequences (≈0.3 off).
* ``attention_mask`` must be ``None``: an all-ones 2-D mask also switches detection off
  (≈0.3 off). Arange ``position_ids`` (no restart) give cross-sequence attention and
  wrong rotary positions (≈0.3 off).
* An explicit 4-D block-diagonal mask (:func:`block_causal_mask`) with the restarting
  ``position_ids`` is exact for ``sdpa`` (≈5e-7), but costs ``nnz²`` memory. ``eager``
  *adds* the mask to the scores, so a bool mask there is silently wrong (≈0.28 off; an
  additive 0/-inf float mask is exact), and ``flex_attention`` given a 4-D tensor mask
  crashed the process (``double free or corruption``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from batching.attention import VarlenLayout


@dataclass(frozen=True)
class Packing:
    """A padded ``[B, S]`` batch laid out as one row of its ``nnz`` valid tokens.

    Attributes:
        input_ids: ``[1, nnz]`` the valid tokens of all rows, row after row, each row's
            tokens in their original order.
        position_ids: ``[1, nnz]`` int64 positions restarting at 0 for each sequence.
        cu_seqlens: ``[B + 1]`` int32 cumulative sequence lengths (flash-attn varlen
            convention): sequence ``b`` is ``input_ids[0, cu_seqlens[b]:cu_seqlens[b+1]]``
            (not with a ``layout``: see below).
        max_seqlen: length of the longest sequence (0 when every row is empty).
        indices: ``[nnz]`` int64 positions of the valid tokens in the flattened ``[B*S]``
            padded tensor.
        batch_size: ``B``, rows of the padded batch (zero-length rows included).
        seq_len: ``S``, columns of the padded batch.
        layout: None for a plain packing. Set by :func:`batching.pack_shared_prompts`:
            sequences then share packed prompt tokens, are no longer contiguous runs of the
            row (``cu_seqlens`` only gives their full lengths), and the layout says which
            packed tokens each attends over.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    indices: torch.Tensor
    batch_size: int
    seq_len: int
    layout: VarlenLayout | None = None

    @property
    def nnz(self) -> int:
        """Number of valid (packed) tokens."""
        return self.indices.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[B]`` int32 valid-token count of every row."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def row_ids(self) -> torch.Tensor:
        """``[nnz]`` int64 padded-batch row each packed token came from."""
        return torch.div(self.indices, self.seq_len, rounding_mode="floor")

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a packed HF causal-LM forward (see the module docstring).

        ``attention_mask=None`` and ``use_cache=False`` are what make transformers build
        the block-diagonal causal mask from the restarting ``position_ids`` (``sdpa``,
        ``eager``). The flash-attn varlen kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``)
        are what ``flash_attention_2`` and a varlen attention registered with transformers
        (:func:`batching.varlen_causal_attention`) read instead; other attention
        implementations ignore them.

        A shared-prompt packing (``layout`` set) passes its layout as ``packed_layout``
        instead, and no varlen kwargs: they could not describe it. Only an attention that
        reads the layout (:func:`batching.varlen_causal_attention`) computes it correctly.
        """
        if self.layout is not None:
            return {
                "input_ids": self.input_ids,
                "position_ids": self.position_ids,
                "attention_mask": None,
                "use_cache": False,
                "packed_layout": self.layout,
            }
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": None,
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def to(self, device: torch.device | str) -> Packing:
        """Return a copy with every tensor moved to ``device``."""
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            indices=self.indices.to(device),
            layout=None if self.layout is None else self.layout.to(device),
        )


def _check_pack_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(
            f"`input_ids` must have shape [B, S], got {tuple(input_ids.shape)} "
            f"({input_ids.dim()} dims)"
        )
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or (input_ids.dtype == torch.bool)
    ):
        raise ValueError(f"`input_ids` must hold integer token ids, got dtype {input_ids.dtype}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` has shape {tuple(attention_mask.shape)} but `input_ids` has "
            f"shape {tuple(input_ids.shape)}; they must match"
        )
    if attention_mask.device != input_ids.device:
        raise ValueError(
            f"`attention_mask` is on {attention_mask.device} but `input_ids` is on "
            f"{input_ids.device}; they must be on the same device"
        )
    # A fractional or 2-valued-but-not-0/1 mask would be silently binarised below.
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("`attention_mask` must contain only 0 and 1 (1 = valid token)")


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packing:
    """Drop the padding of a ``[B, S]`` batch and lay its valid tokens out as one row.

    Any padding layout works (left, right, both, even holes): a row's valid tokens, in
    their order, form its sequence, exactly what a padded HF forward with
    ``position_ids = cumsum(mask) - 1`` attends over. Rows without valid tokens give
    sequences of length 0.

    Args:
        input_ids: ``[B, S]`` integer token ids.
        attention_mask: ``[B, S]`` bool or numeric, 1 = valid token, 0 = padding.

    Returns:
        The :class:`Packing`, on the device of ``input_ids``.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or a mask value other than 0/1.
    """
    _check_pack_inputs(input_ids, attention_mask)
    batch_size, seq_len = input_ids.shape
    mask = attention_mask.to(torch.bool)
    indices = mask.reshape(-1).nonzero().squeeze(-1)
    # The same positions the padded forward uses, so rotary embeddings match exactly.
    positions = (mask.long().cumsum(dim=-1) - 1).reshape(-1)[indices]
    seq_lens = mask.sum(dim=-1)
    cu_seqlens = torch.nn.functional.pad(seq_lens.cumsum(dim=0), (1, 0)).to(torch.int32)
    max_seqlen = int(seq_lens.max()) if batch_size > 0 else 0
    return Packing(
        input_ids=input_ids.reshape(-1)[indices].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        indices=indices,
        batch_size=batch_size,
        seq_len=seq_len,
    )


def pack_values(values: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Pack another per-token tensor (labels, masks, old log-probs) like ``input_ids``.

    Args:
        values: ``[B, S, ...]`` aligned with the batch that was packed.
        packing: from :func:`pack`.

    Returns:
        ``[1, nnz, ...]``. Differentiable with respect to ``values``.
    """
    expected = (packing.batch_size, packing.seq_len)
    if values.dim() < 2 or tuple(values.shape[:2]) != expected:
        raise ValueError(
            f"`values` must have shape [B, S, ...] = [{expected[0]}, {expected[1]}, ...], "
            f"got {tuple(values.shape)}"
        )
    flat = values.reshape(-1, *values.shape[2:])
    return flat[packing.indices.to(values.device)].unsqueeze(0)


def _drop_packed_batch_dim(packed_values: torch.Tensor, nnz: int) -> torch.Tensor:
    # `[1, nnz, ...]` is read as the packed batch dim; only when that does not fit is the
    # tensor taken as `[nnz, ...]` (so with nnz == 1 a `[1, 1]` tensor unpacks to `[B, S]`).
    if packed_values.dim() >= 2 and packed_values.shape[0] == 1 and packed_values.shape[1] == nnz:
        return packed_values[0]
    if packed_values.dim() >= 1 and packed_values.shape[0] == nnz:
        return packed_values
    raise ValueError(
        f"`packed_values` must have shape [1, nnz, ...] or [nnz, ...] with nnz = {nnz}, "
        f"got {tuple(packed_values.shape)}"
    )


def unpack(packed_values: torch.Tensor, packing: Packing, pad_value: float = 0) -> torch.Tensor:
    """Scatter per-token packed values back to the padded ``[B, S, ...]`` layout.

    Args:
        packed_values: ``[1, nnz, ...]`` or ``[nnz, ...]``, e.g. packed logits
            ``[1, nnz, V]`` or per-token log-probs ``[1, nnz]``.
        packing: from :func:`pack`.
        pad_value: fill value of the padding positions.

    Returns:
        ``[B, S, ...]`` in the dtype of ``packed_values``: valid positions hold their
        packed value, padding holds ``pad_value``. Differentiable with respect to
        ``packed_values`` (padding positions get no gradient).
    """
    flat = _drop_packed_batch_dim(packed_values, packing.nnz)
    rest = flat.shape[1:]
    out = flat.new_full((packing.batch_size * packing.seq_len, *rest), pad_value)
    # Out-of-place index_put keeps the autograd edge to `flat`.
    out = out.index_put((packing.indices.to(flat.device),), flat)
    return out.reshape(packing.batch_size, packing.seq_len, *rest)


def next_token_labels(packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels for next-token log-probs computed directly on the packed row.

    ``labels[0, t]`` is the token after packed token ``t``; it only means something when
    both belong to the same sequence, which ``valid`` marks (False at each sequence's last
    token). ``unpack(logp, packing)`` then holds at ``[b, s]`` the log-prob of the token
    that follows ``s`` in row ``b``, the padded ``logits[:, :-1]`` / ``input_ids[:, 1:]``
    alignment wherever ``s + 1`` is a valid token.

    Args:
        packing: from :func:`pack`.

    Returns:
        ``(labels, valid)``: ``[1, nnz]`` token ids (in range everywhere, so a gather is
        safe) and ``[1, nnz]`` bool.
    """
    labels = torch.roll(packing.input_ids, shifts=-1, dims=1)
    rows = packing.row_ids
    valid = torch.zeros_like(rows, dtype=torch.bool)
    valid[:-1] = rows[:-1] == rows[1:]
    return labels, valid.unsqueeze(0)


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B + 1]`` int32 boundaries of a packed ``[1, nnz]`` row: a sequence starts wherever
    the position does not continue the previous one (transformers' packing rule).

    Raises:
        ValueError: a sequence found this way does not start at position 0 (a shared-prompt
            packing, :func:`~batching.pack_shared_prompts`, whose samples continue their
            prompt's positions: it needs its ``Packing.layout``, not positions).
    """
    positions = position_ids[0]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    boundaries = starts.nonzero().squeeze(-1)
    if bool((positions[boundaries] != 0).any()):
        raise ValueError(
            "a packed row's sequences must start at position 0 (a shared-prompt packing "
            "needs its packed_layout kwarg to reach the attention)"
        )
    end = torch.tensor([positions.shape[0]], device=positions.device)
    return torch.cat([boundaries, end]).to(torch.int32)


def block_causal_mask(packing: Packing) -> torch.Tensor:
    """Explicit block-diagonal causal mask of the packed row (``nnz²`` memory).

    Only for a model whose mask creation does not detect packing from ``position_ids``;
    pass it as ``attention_mask`` together with ``packing.position_ids`` to an ``sdpa``
    model. Not for ``eager`` (which adds the mask: convert to 0 / -inf first) nor for
    ``flex_attention`` (see the module docstring).

    Args:
        packing: from :func:`pack`.

    Returns:
        ``[1, 1, nnz, nnz]`` bool, True where query ``i`` may attend to key ``j``: same
        sequence and ``j <= i``.
    """
    rows = packing.row_ids
    same_sequence = rows[:, None] == rows[None, :]
    causal = torch.ones_like(same_sequence).tril()
    return (same_sequence & causal)[None, None]
