"""Slow, obviously-correct pure-Python references for every public ``ppo_core`` function.

Each ``ref_*`` function is written from the written specification of the PPO math (the
verl-compatible semantics), not from the vectorized code: it reads its tensor arguments
once with ``.tolist()``, computes with plain Python floats, ``for`` loops and
:mod:`math`, and returns ``torch.float64`` tensors of the same shape(s) as the public
function (scalars come back as Python floats where the public function returns a
scalar loss or metric). Nothing here imports ``ppo_core``, so a comparison against these
functions can fail.

The references are used by ``test_reference.py`` (random inputs, tight float64
tolerances) and by the benchmark ``benchmarks/ppo_core_bench.py`` (``ref_compute_gae``,
``ref_policy_loss`` and ``ref_value_loss`` at B=1024, T=4096), so they convert each input
to lists once and never index tensors element by element.

Conventions shared with the spec:

- masked means divide by ``Σm + 1e-8`` (all-masked input gives 0);
- whitening uses the unbiased masked variance and transforms every position;
- masks are read as floats (bool masks become 0.0 / 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

EPS = 1e-8
"""Denominator epsilon of masked means and of whitening."""

_KL_NAMES = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}

# --------------------------------------------------------------------------------------
# list helpers
# --------------------------------------------------------------------------------------


def _flat(t: torch.Tensor) -> list[float]:
    """All elements of ``t`` in row-major order, as Python floats."""
    values = t.reshape(-1).tolist()
    return values if t.is_floating_point() else [float(v) for v in values]


def _rows(t: torch.Tensor) -> list[list[float]]:
    """A 2-D tensor as a list of rows of Python floats (bool/int masks become 0.0/1.0)."""
    rows = t.tolist()
    return rows if t.is_floating_point() else [[float(v) for v in row] for row in rows]


def _out(values, shape) -> torch.Tensor:
    """Float64 tensor of ``shape`` from a flat or nested list (or one float)."""
    return torch.tensor(values, dtype=torch.float64).reshape(tuple(shape))


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


# --------------------------------------------------------------------------------------
# masked ops
# --------------------------------------------------------------------------------------


def _masked_reduce(x: torch.Tensor, mask: torch.Tensor, dim: int | None, mean: bool):
    if tuple(x.shape) != tuple(mask.shape):
        raise ValueError("x and mask must have the same shape")
    xs, ms = _flat(x), _flat(mask)
    if dim is None:
        total = 0.0
        count = 0.0
        for v, m in zip(xs, ms, strict=True):
            total += v * m
            count += m
        return torch.tensor(total / (count + EPS) if mean else total, dtype=torch.float64)
    shape = list(x.shape)
    d = dim % len(shape)
    outer, n, inner = _prod(shape[:d]), shape[d], _prod(shape[d + 1 :])
    out = []
    for o in range(outer):
        for i in range(inner):
            total = 0.0
            count = 0.0
            for k in range(n):
                idx = (o * n + k) * inner + i
                total += xs[idx] * ms[idx]
                count += ms[idx]
            out.append(total / (count + EPS) if mean else total)
    return _out(out, shape[:d] + shape[d + 1 :])


def ref_masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m over ``dim`` (everything when ``None``)."""
    return _masked_reduce(x, mask, dim, mean=False)


def ref_masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / (Σ m + 1e-8) over ``dim`` (everything when ``None``)."""
    return _masked_reduce(x, mask, dim, mean=True)


def _list_mean_var(xs: list[float], ms: list[float], unbiased: bool) -> tuple[float, float]:
    """(masked mean, masked variance) of flat lists."""
    total = 0.0
    count = 0.0
    for v, m in zip(xs, ms, strict=True):
        total += v * m
        count += m
    mu = total / (count + EPS)
    sq = 0.0
    for v, m in zip(xs, ms, strict=True):
        sq += (v - mu) * (v - mu) * m
    var = sq / (count + EPS)
    if unbiased:
        if count < 2:
            raise ValueError(f"unbiased masked variance needs >= 2 valid entries, got {count}")
        var = var * count / (count - 1.0)
    return mu, var


def _list_whiten(xs: list[float], ms: list[float], shift_mean: bool = True) -> list[float]:
    mu, var = _list_mean_var(xs, ms, unbiased=True)
    scale = 1.0 / math.sqrt(var + EPS)
    add = 0.0 if shift_mean else mu
    return [(v - mu) * scale + add for v in xs]


def ref_masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Masked variance over the whole tensor; Bessel-corrected when ``unbiased``.

    Raises ``ValueError`` when ``unbiased`` and Σm < 2.
    """
    _, var = _list_mean_var(_flat(x), _flat(mask), unbiased)
    return torch.tensor(var, dtype=torch.float64)


def ref_masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − μ) / sqrt(σ²_unbiased + 1e-8) at every position; + μ when not ``shift_mean``."""
    return _out(_list_whiten(_flat(x), _flat(mask), shift_mean), x.shape)


# --------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------


def _logsumexp(zs: list[float]) -> float:
    top = max(zs)
    if math.isinf(top):
        return top
    return top + math.log(sum(math.exp(z - top) for z in zs))


def ref_logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(z / τ) at the label, for every leading position. Any input dtype."""
    vocab = logits.shape[-1]
    rows = _flat(logits)
    labs = [int(v) for v in labels.reshape(-1).tolist()]
    out = []
    for i, label in enumerate(labs):
        z = [v / temperature for v in rows[i * vocab : (i + 1) * vocab]]
        out.append(z[label] - _logsumexp(z))
    return _out(out, labels.shape)


def ref_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z at every leading position."""
    vocab = logits.shape[-1]
    flat = _flat(logits)
    out = []
    for i in range(len(flat) // vocab if vocab else 0):
        z = flat[i * vocab : (i + 1) * vocab]
        lse = _logsumexp(z)
        out.append(lse - sum(math.exp(v - lse) * v for v in z))
    return _out(out, logits.shape[:-1])


# --------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------


def _kl_fn(estimator: str):
    name = estimator[:-1] if estimator.endswith("+") else estimator
    if name not in _KL_NAMES:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    kind = _KL_NAMES[name]
    if kind == "k1":
        return lambda d: d
    if kind == "abs":
        return abs
    if kind == "k2":
        return lambda d: 0.5 * d * d

    def k3(d: float) -> float:
        kappa = _clamp(-d, -20.0, 20.0)
        return _clamp(math.exp(kappa) - kappa - 1.0, -10.0, 10.0)

    return k3


def ref_kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate of Δ = logprob − ref_logprob (forward value only)."""
    fn = _kl_fn(estimator)
    a, b = _flat(logprob), _flat(ref_logprob)
    return _out([fn(x - y) for x, y in zip(a, b, strict=True)], logprob.shape)


def ref_apply_kl_penalty(
    token_scores: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    estimator: str = "k1",
) -> tuple[torch.Tensor, float]:
    """(scores − β·KL·m, batch mean over all rows of each row's masked token-mean KL)."""
    fn = _kl_fn(estimator)
    beta = float(kl_coef)
    scores, old, ref, mask = (
        _rows(token_scores),
        _rows(old_logprob),
        _rows(ref_logprob),
        _rows(response_mask),
    )
    rewards = []
    seq_kls = []
    for s_row, o_row, r_row, m_row in zip(scores, old, ref, mask, strict=True):
        kld_sum = 0.0
        count = 0.0
        out_row = []
        for s, o, r, m in zip(s_row, o_row, r_row, m_row, strict=True):
            kld = fn(o - r) * m
            out_row.append(s - beta * kld)
            kld_sum += kld * m
            count += m
        rewards.append(out_row)
        seq_kls.append(kld_sum / (count + EPS))
    kl_metric = sum(seq_kls) / len(seq_kls) if seq_kls else math.nan
    return _out(rewards, token_scores.shape), kl_metric


# --------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------


def ref_compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by a reverse scan that skips masked tokens; advantages whitened over the batch."""
    rewards, vals, mask = _rows(token_rewards), _rows(values), _rows(response_mask)
    gl = gamma * lam
    adv_rows = []
    ret_flat = []
    for r_row, v_row, m_row in zip(rewards, vals, mask, strict=True):
        n = len(r_row)
        adv = [0.0] * n
        nextvalue = 0.0
        lastgaelam = 0.0
        for t in range(n - 1, -1, -1):
            if m_row[t]:
                delta = r_row[t] + gamma * nextvalue - v_row[t]
                lastgaelam = delta + gl * lastgaelam
                nextvalue = v_row[t]
            adv[t] = lastgaelam
        adv_rows.append(adv)
        ret_flat.extend(a + v for a, v in zip(adv, v_row, strict=True))
    flat_adv = [a for row in adv_rows for a in row]
    flat_mask = [m for row in mask for m in row]
    whitened = _list_whiten(flat_adv, flat_mask)
    shape = token_rewards.shape
    return _out(whitened, shape), _out(ret_flat, shape)


def _groups(group_ids, batch: int) -> list:
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != batch:
        raise ValueError("group_ids must have one entry per score")
    return ids


def _broadcast(adv: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    mask = _rows(response_mask)
    return _out(
        [[a * m for m in m_row] for a, m_row in zip(adv, mask, strict=True)], response_mask.shape
    )


def ref_compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s − mean_g) / (std_g + eps) (unbiased std; a group of one: mean 0, std 1), × mask."""
    s = _flat(scores)
    ids = _groups(group_ids, len(s))
    members: dict = {}
    for i, key in enumerate(ids):
        members.setdefault(key, []).append(i)
    adv = [0.0] * len(s)
    for idx in members.values():
        n = len(idx)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(s[i] for i in idx) / n
            std = math.sqrt(sum((s[i] - mean) ** 2 for i in idx) / (n - 1))
        for i in idx:
            adv[i] = (s[i] - mean) / (std + eps) if norm_by_std else s[i] - mean
    out = _broadcast(adv, response_mask)
    return out, out.clone()


def ref_compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s_i − mean of the other members of its group (s_i for a group of one), × mask."""
    s = _flat(scores)
    ids = _groups(group_ids, len(s))
    members: dict = {}
    for i, key in enumerate(ids):
        members.setdefault(key, []).append(i)
    adv = [0.0] * len(s)
    for idx in members.values():
        n = len(idx)
        for i in idx:
            if n == 1:
                adv[i] = s[i]
            else:
                others = sum(s[j] for j in idx if j != i)
                adv[i] = s[i] - others / (n - 1)
    out = _broadcast(adv, response_mask)
    return out, out.clone()


def ref_compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """G_t = r_t + γ·running, running = G_t·m_t; advantages = whiten(G)·m; returns G."""
    rewards, mask = _rows(token_rewards), _rows(response_mask)
    g_flat = []
    for r_row, m_row in zip(rewards, mask, strict=True):
        n = len(r_row)
        g = [0.0] * n
        running = 0.0
        for t in range(n - 1, -1, -1):
            running = r_row[t] + gamma * running
            g[t] = running
            running = running * m_row[t]
        g_flat.extend(g)
    m_flat = [m for row in mask for m in row]
    adv = [w * m for w, m in zip(_list_whiten(g_flat, m_flat), m_flat, strict=True)]
    shape = token_rewards.shape
    return _out(adv, shape), _out(g_flat, shape)


# --------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------

_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _aggregate_rows(
    loss_rows: list[list[float]],
    mask_rows: list[list[float]],
    mode: str,
    global_num_tokens,
    global_num_seqs,
    dp_size: int,
    loss_scale_factor,
) -> float:
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    if mode == "token-mean":
        total = 0.0
        count = 0.0
        for l_row, m_row in zip(loss_rows, mask_rows, strict=True):
            for v, m in zip(l_row, m_row, strict=True):
                total += v * m
                count += m
        if global_num_tokens is None:
            return total / (count + EPS)
        return total / float(global_num_tokens) * dp_size
    length = len(loss_rows[0]) if loss_rows else 0
    scale = float(length if loss_scale_factor is None else loss_scale_factor)
    seq_total = 0.0
    num_valid = 0
    for l_row, m_row in zip(loss_rows, mask_rows, strict=True):
        token_sum = 0.0
        count = 0.0
        for v, m in zip(l_row, m_row, strict=True):
            token_sum += v * m
            count += m
        if count <= 0:
            continue  # an all-masked row neither contributes nor counts
        num_valid += 1
        if mode == "seq-mean-token-sum":
            seq_total += token_sum
        elif mode == "seq-mean-token-mean":
            seq_total += token_sum / count
        else:
            seq_total += token_sum / scale
    if global_num_seqs is None:
        return seq_total / num_valid if num_valid else 0.0
    return seq_total / float(global_num_seqs) * dp_size


def ref_aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> float:
    """Scalar loss of a ``[B, T]`` per-token loss under one of the four aggregation modes."""
    return _aggregate_rows(
        _rows(loss_mat),
        _rows(mask),
        mode,
        global_num_tokens,
        global_num_seqs,
        dp_size,
        loss_scale_factor,
    )


def _flat_masked_mean(xs: list[float], ms: list[float]) -> float:
    total = 0.0
    count = 0.0
    for v, m in zip(xs, ms, strict=True):
        total += v * m
        count += m
    return total / (count + EPS)


def ref_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[float, dict[str, float]]:
    """PPO clipped surrogate with dual clip; returns (loss, metrics) as Python floats."""
    new, old, adv, mask = (
        _rows(logprob),
        _rows(old_logprob),
        _rows(advantages),
        _rows(response_mask),
    )
    lo, hi = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high
    exp = math.exp
    loss_rows = []
    clip_flags = []
    dual_flags = []
    neg_log_ratio = []
    for n_row, o_row, a_row in zip(new, old, adv, strict=True):
        l_row = []
        for n, o, a in zip(n_row, o_row, a_row, strict=True):
            d = _clamp(n - o, -20.0, 20.0)
            rho = exp(d)
            l1 = -a * rho
            l2 = -a * _clamp(rho, lo, hi)
            ell = l1 if l1 >= l2 else l2
            clip_flags.append(1.0 if l2 > l1 else 0.0)
            dual = 0.0
            if clip_ratio_c is not None and a < 0:
                bound = -a * clip_ratio_c
                if ell > bound:
                    dual = 1.0
                    ell = bound
            dual_flags.append(dual)
            neg_log_ratio.append(-d)
            l_row.append(ell)
        loss_rows.append(l_row)
    loss = _aggregate_rows(
        loss_rows, mask, agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor
    )
    m_flat = [m for row in mask for m in row]
    metrics = {
        "pg_loss": loss,
        "pg_clipfrac": _flat_masked_mean(clip_flags, m_flat),
        "pg_clipfrac_lower": _flat_masked_mean(dual_flags, m_flat),
        "ppo_kl": _flat_masked_mean(neg_log_ratio, m_flat),
    }
    return loss, metrics


def ref_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float = 0.5,
    agg_mode: str = "token-mean",
    global_num_tokens=None,
    global_num_seqs=None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[float, dict[str, float]]:
    """½ · agg(max((V − R)², (clip(V, V_old ± ε) − R)²)); returns (loss, metrics) as floats."""
    vals, old, rets, mask = (
        _rows(values),
        _rows(old_values),
        _rows(returns),
        _rows(response_mask),
    )
    loss_rows = []
    clip_flags = []
    v_flat = []
    for v_row, o_row, r_row in zip(vals, old, rets, strict=True):
        l_row = []
        for v, o, r in zip(v_row, o_row, r_row, strict=True):
            vc = _clamp(v, o - clip_range, o + clip_range)
            unclipped = (v - r) * (v - r)
            clipped = (vc - r) * (vc - r)
            l_row.append(clipped if clipped > unclipped else unclipped)
            clip_flags.append(1.0 if clipped > unclipped else 0.0)
            v_flat.append(v)
        loss_rows.append(l_row)
    loss = 0.5 * _aggregate_rows(
        loss_rows, mask, agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor
    )
    m_flat = [m for row in mask for m in row]
    metrics = {
        "vf_loss": loss,
        "vf_clipfrac": _flat_masked_mean(clip_flags, m_flat),
        "vpred_mean": _flat_masked_mean(v_flat, m_flat),
    }
    return loss, metrics
