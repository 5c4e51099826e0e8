"""Per-token log-probabilities and entropies from logits, in row chunks, with a hand-written
backward.

A full ``log_softmax`` of ``[B, T, V]`` logits costs another ``B·T·V`` floats (and for
bf16 logits a float32 copy doubles that again): at V = 152k that is gigabytes. Here the
logits are flattened to ``[N, V]`` rows and processed a bounded number of rows at a time in
float32, forward *and* backward: autograd keeps only the logits themselves (which the
caller holds anyway) and three floats per row, and the backward recomputes each chunk's
softmax. Besides memory this saves time: the elementwise passes over ``[N, V]`` dominate
on CPU (SmolLM2, 2000 response tokens × 49k vocabulary, bf16, log-prob + entropy forward and
backward: 2.0–2.9 s through autograd of ``logsumexp``/``softmax``, 0.74 s here).

Formulas, with z = logits / τ, p = softmax(z), lse = logsumexp(z):

- log p(y) = z_y − lse;                ∂/∂z = onehot(y) − p
- H = lse − Σ p·z = −Σ p·log p;          ∂/∂z = −p ⊙ (log p + H)
"""

from __future__ import annotations

import math

import torch

# Elements of one float32 working chunk (64 MiB); big enough to keep kernels efficient.
_CHUNK_ELEMENTS = 1 << 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 (tests and references); everything else is computed in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def _exp_floor(dtype: torch.dtype) -> float:
    """Just above log of the smallest normal float: where exp() is (nearly) denormal or 0,
    CPU exp takes a ~7x slower path (fp32 exp of 16.7M values in [-120, 0]: 140 ms, clamped
    at -86: 19 ms; at exactly log(tiny) still 145 ms). Real LM logits sit far below their
    row's maximum, so clamping there first (an error of at most e·tiny per vocabulary
    entry) is what keeps this fast."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = chunk.to(_compute_dtype(chunk.dtype), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _forward_chunk(chunk, labels, temperature, with_entropy):
    """``(log p(y), H or None, lse)`` of one ``[n, V]`` chunk, in 5–6 passes over it."""
    z = _scaled(chunk, temperature)
    top = z.amax(-1, keepdim=True)
    picked = z.gather(-1, labels[:, None]).squeeze(-1)
    z.sub_(top).clamp_(min=_exp_floor(z.dtype))  # z − max: exp cannot overflow
    e = z.exp()
    total = e.sum(-1)
    lse = total.log() + top.squeeze(-1)
    entropy = None
    if with_entropy:  # H = log Σe − Σ e·(z − max) / Σe; a batched dot, no [n, V] product
        entropy = total.log() - torch.bmm(e[:, None, :], z[:, :, None]).view(-1) / total
    return picked - lse, entropy, lse


def _backward_chunk(chunk, labels, lse, entropy, grad_logprob, grad_entropy, temperature):
    """∂(g_lp·log p(y) + g_H·H)/∂logits for one chunk, in place in one float32 buffer."""
    log_p = _scaled(chunk, temperature).sub_(lse[:, None])
    p = log_p.clamp_(min=_exp_floor(log_p.dtype)).exp()
    grad = log_p  # reuse the buffer: −p ⊙ (g_lp + g_H·(log p + H)), then + g_lp at y
    if grad_entropy is not None:
        grad.add_(entropy[:, None]).mul_(grad_entropy[:, None])
    else:
        grad.zero_()
    if grad_logprob is not None:
        grad.add_(grad_logprob[:, None])
    grad.mul_(p).neg_()
    if grad_logprob is not None:
        grad.scatter_add_(-1, labels[:, None], grad_logprob[:, None])
    return grad.div_(temperature) if temperature != 1.0 else grad


class _LogprobEntropy(torch.autograd.Function):
    """Chunked log-probs (and entropies) of ``[N, V]`` logits; the backward recomputes the
    softmax chunk by chunk from the saved logits (no ``[N, V]`` float32 tensor is kept)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, with_entropy: bool):
        rows = _rows_per_chunk(logits.shape[-1])
        logprob, entropy, lse = [], [], []
        for chunk, y in zip(logits.split(rows), labels.split(rows), strict=True):
            lp, h, s = _forward_chunk(chunk, y, temperature, with_entropy)
            logprob.append(lp), lse.append(s), entropy.append(h)
        empty = logits.new_zeros(0, dtype=_compute_dtype(logits.dtype))
        logprob, lse = (torch.cat(x) if x else empty for x in (logprob, lse))
        entropy = torch.cat(entropy) if with_entropy and entropy else empty
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.save_for_backward(logits, labels, lse, entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None
        rows = _rows_per_chunk(logits.shape[-1])
        grad = torch.empty_like(logits)
        count = len(lse.split(rows))
        chunks = zip(
            logits.split(rows),
            labels.split(rows),
            lse.split(rows),
            _split_or_none(entropy if grad_entropy is not None else None, rows, count),
            _split_or_none(grad_logprob, rows, count),
            _split_or_none(grad_entropy, rows, count),
            grad.split(rows),
            strict=True,
        )
        for chunk, y, s, h, g_lp, g_h, out in chunks:
            out.copy_(_backward_chunk(chunk, y, s, h, g_lp, g_h, ctx.temperature))
        return grad, None, None, None


def _split_or_none(t: torch.Tensor | None, rows: int, count: int) -> tuple:
    return t.split(rows) if t is not None else (None,) * count


def _checked_flat_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"`labels` has shape {tuple(labels.shape)} but `logits` has shape "
            f"{tuple(logits.shape)}; labels must equal logits.shape[:-1]"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must hold integer token ids, got dtype {labels.dtype}")
    return labels.reshape(-1).long()


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z / τ)[label] and the entropy of softmax(z / τ) at every position, in one
    chunked pass (one softmax per chunk serves both, forward and backward).

    log p(y) = z_y/τ − logsumexp(z/τ);  H = −Σ p·log p.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        labels: ``[B, T]`` (the leading shape of ``logits``), integer token ids.
        temperature: τ > 0, the sampling temperature the tokens were drawn with.
        with_entropy: also compute the entropy (one more pass per chunk).

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``, float32 (float64 for float64 logits).
        Differentiable (first order) with respect to ``logits``.
    """
    flat_labels = _checked_flat_labels(logits, labels)
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    logprob, entropy = _LogprobEntropy.apply(flat, flat_labels, float(temperature), with_entropy)
    entropy = entropy.reshape(labels.shape) if with_entropy else None
    return logprob.reshape(labels.shape), entropy


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
    return logprobs_and_entropy(logits, labels, temperature, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) at every position: H = logsumexp(z) − Σ softmax(z)·z.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.

    Returns:
        ``[B, T]`` entropies in nats, float32 (float64 for float64 logits). Differentiable.
    """
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return logprobs_and_entropy(logits, labels)[1]


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Σ_v p_v² of p = softmax(z / τ) at every position, chunk by chunk in float32: the
    collision probability, which the optimal token baseline reads
    (:func:`ppo_core.compute_optimal_token_baseline_advantages`; verl's
    ``calculate_sum_pi_squared``). 1/V ≤ Σp² ≤ 1; ‖∇_z log p(y)‖² = 1 − 2p(y) + Σp².

    Σp² = Σ_v exp(2(z_v − lse)) = Σ e_v² / (Σ e_v)², e = exp(z − max z).

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[..., V]``), any float dtype.
        temperature: τ > 0, the sampling temperature.

    Returns:
        ``[B, T]``, float32 (float64 for float64 logits); not differentiable.
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=_compute_dtype(flat.dtype), device=flat.device)
    step = _rows_per_chunk(flat.shape[-1])
    for start in range(0, flat.shape[0], step):
        z = _scaled(flat[start : start + step], temperature)
        z.sub_(z.amax(-1, keepdim=True)).clamp_(min=_exp_floor(z.dtype))
        e = z.exp_()
        out[start : start + step] = e.square().sum(-1) / e.sum(-1).square()
    return out.reshape(logits.shape[:-1])
