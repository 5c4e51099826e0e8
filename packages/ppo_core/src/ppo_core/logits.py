"""Per-token log-probabilities and entropies from logits, computed in row chunks.

A full ``log_softmax`` of ``[B, T, V]`` logits costs another ``B·T·V`` floats (and for
bf16 logits a float32 copy doubles that again): at V = 152k that is gigabytes. Both
functions here flatten to ``[N, V]`` rows and process a bounded number of rows at a time
in float32, so the extra memory is one chunk, not one copy of the logits.
"""

from __future__ import annotations

import torch

# Elements of one float32 working chunk (64 MiB); big enough to keep kernels efficient.
_CHUNK_ELEMENTS = 1 << 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 (tests and references); everything else is computed in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[N, V]`` → row chunks of at most ``_CHUNK_ELEMENTS`` elements.

    ``split``, not slicing: the backward of a split is one concatenation of the chunks'
    gradients, while each slice's backward zero-fills and adds a whole ``[N, V]`` gradient
    (measured on SmolLM2's 49k vocabulary: ~1.5 s of a 6 s actor forward + backward).
    """
    rows = max(1, _CHUNK_ELEMENTS // max(flat.shape[-1], 1))
    return flat.split(rows) if flat.shape[0] else ()


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(z / τ)[label] for every position, without a full log-softmax copy.

    log p(y) = z_y/τ − logsumexp(z/τ), evaluated chunk by chunk in float32.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        labels: ``[B, T]`` (the leading shape of ``logits``), integer token ids.
        temperature: τ > 0, the sampling temperature the tokens were drawn with.

    Returns:
        ``[B, T]`` log-probabilities, float32 (float64 for float64 logits). Differentiable.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"`labels` has shape {tuple(labels.shape)} but `logits` has shape "
            f"{tuple(logits.shape)}; labels must equal logits.shape[:-1]"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must hold integer token ids, got dtype {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1).long()
    dtype = _compute_dtype(logits.dtype)
    pieces = []
    label_chunks = flat_labels.split(max(1, _CHUNK_ELEMENTS // max(vocab, 1)))
    for chunk, labels_of_chunk in zip(_row_chunks(flat_logits), label_chunks, strict=True):
        z = chunk.to(dtype)
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, labels_of_chunk).squeeze(-1)
        pieces.append(picked - torch.logsumexp(z, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=dtype)
    return out.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) at every position: H = logsumexp(z) − Σ softmax(z)·z.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.

    Returns:
        ``[B, T]`` entropies in nats, float32 (float64 for float64 logits). Differentiable.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    dtype = _compute_dtype(logits.dtype)
    pieces = []
    for chunk in _row_chunks(flat):
        z = chunk.to(dtype)
        probs = torch.softmax(z, dim=-1)
        pieces.append(torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])
