"""Slow pure-Python references for verl's other policy losses (``ppo_core.policy_losses``,
``ppo_core.cov_losses``), written from the papers' formulas as verl implements them, with
plain floats and loops over rows and tokens (as ``reference.py``, whose helpers they use;
nothing here imports ``ppo_core``). Each returns the loss as a Python float. Loaded by
``test_policy_losses.py`` after ``reference.py`` (as ``ppo_core_tests_reference``)."""

from __future__ import annotations

import math

from ppo_core_tests_reference import _aggregate_rows, _clamp, _rows

_SIG = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731


def _inputs(logprob, old_logprob, advantages, mask):
    return _rows(logprob), _rows(old_logprob), _rows(advantages), _rows(mask)


def ref_gspo_loss(
    logprob, old_logprob, advantages, mask, *, lo=0.2, hi=0.2, agg="seq-mean-token-mean"
):
    new, old, adv, m = _inputs(logprob, old_logprob, advantages, mask)
    rows = []
    for n_row, o_row, a_row, m_row in zip(new, old, adv, m, strict=True):
        length = max(sum(m_row), 1.0)
        s = math.exp(
            min(
                sum((n - o) * k for n, o, k in zip(n_row, o_row, m_row, strict=True)) / length, 10.0
            )
        )
        rows.append([max(-a * s, -a * _clamp(s, 1 - lo, 1 + hi)) for a in a_row])
    return _aggregate_rows(rows, m, agg, None, None, 1, None)


def ref_sapo_loss(
    logprob, old_logprob, advantages, mask, *, tau_pos=1.0, tau_neg=1.05, agg="seq-mean-token-mean"
):
    new, old, adv, m = _inputs(logprob, old_logprob, advantages, mask)
    rows = []
    for n_row, o_row, a_row in zip(new, old, adv, strict=True):
        row = []
        for n, o, a in zip(n_row, o_row, a_row, strict=True):
            tau = tau_pos if a > 0 else tau_neg
            rho = math.exp(_clamp(n - o, -20.0, 20.0))
            row.append(-_SIG(tau * (rho - 1.0)) * 4.0 / tau * a)
        rows.append(row)
    return _aggregate_rows(rows, m, agg, None, None, 1, None)


def ref_cispo_loss(logprob, old_logprob, advantages, mask, *, lo=0.2, hi=0.2, agg="token-mean"):
    new, old, adv, m = _inputs(logprob, old_logprob, advantages, mask)
    rows = []
    for n_row, o_row, a_row in zip(new, old, adv, strict=True):
        rows.append([
            -_clamp(math.exp(_clamp(n - o, -20.0, 20.0)), 1 - lo, 1 + hi) * a * n
            for n, o, a in zip(n_row, o_row, a_row, strict=True)
        ])  # fmt: skip
    return _aggregate_rows(rows, m, agg, None, None, 1, None)


def ref_geo_mean_loss(logprob, old_logprob, advantages, mask, *, lo=0.2, hi=0.2):
    new, old, adv, m = _inputs(logprob, old_logprob, advantages, mask)
    total, count = 0.0, 0
    for n_row, o_row, a_row, m_row in zip(new, old, adv, m, strict=True):
        length = sum(m_row)
        if length <= 0:
            continue
        log_r, a_sum = 0.0, 0.0
        for n, o, a, k in zip(n_row, o_row, a_row, m_row, strict=True):
            d = n - o
            # the side the advantage pushes is clipped: up for A > 0, down for A < 0
            c = min(d, hi) if a > 0 else max(d, -lo) if a < 0 else 0.0
            log_r += c * k
            a_sum += a * k
        total += -(a_sum / length) * math.exp(log_r / length)
        count += 1
    return total / count if count else 0.0


def ref_kl_cov_loss(
    logprob, old_logprob, advantages, mask, *, ratio=0.0002, coef=0.1, agg="token-mean"
):
    new, old, adv, m = _inputs(logprob, old_logprob, advantages, mask)
    valid = [(b, t) for b, row in enumerate(m) for t, k in enumerate(row) if k > 0]
    mean_a = sum(adv[b][t] for b, t in valid) / len(valid)
    mean_l = sum(new[b][t] for b, t in valid) / len(valid)
    cov = {(b, t): (adv[b][t] - mean_a) * (new[b][t] - mean_l) for b, t in valid}
    picked = set(sorted(cov, key=cov.get, reverse=True)[: max(1, int(len(valid) * ratio))])
    rows = []
    for b, (n_row, o_row, a_row) in enumerate(zip(new, old, adv, strict=True)):
        row = []
        for t, (n, o, a) in enumerate(zip(n_row, o_row, a_row, strict=True)):
            ell = -a * math.exp(n - o)
            row.append(ell + coef * abs(n - o) if (b, t) in picked else ell)
        rows.append(row)
    return _aggregate_rows(rows, m, agg, None, None, 1, None)
