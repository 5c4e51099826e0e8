"""Choose a token budget by measuring the real pass: a pure search over a measurement callback.

:func:`search_budget` calls ``measure(budget)`` — one timed pass of *your* training or
forward pass on a micro-batch of ``budget`` tokens, returning a :class:`ProbePoint` (time,
peak memory growth) — at budgets L, 4L, 16L, ... (L: one sequence of full length) up to
``cap`` (the most tokens one micro-batch of that pass can ever hold), and chooses the
largest budget whose memory stays within ``allowance`` GiB and, on CPU, not past the point
where tokens/s stops rising by 5 % (:data:`MIN_GAIN`).

Memory is fitted as ``a + b·tokens`` (``+ c·tokens²`` with ``quadratic=True``: attention
with a dense ``[nnz, nnz]`` mask). The series stops where measuring the next budget would
cost more than ``COST_SHARE`` of what the pass takes in one step (``step_tokens``): the
larger budgets are the costly ones, which is why the series grows by 4x, not 2x. Where
tokens/s was still rising at the largest point measured, the choice goes on up to ``cap``
for as long as memory scaled from that point — proportionally (quadratically), never less
than the fit — stays within the allowance. Why not the fit alone: a peak is the larger of
a constant (gradients, gathered parameters) and what grows with the tokens, so small
budgets hide the growth; scaling from a point bounds both shapes from above
(``max(a, b·t)`` and ``a + b·t``, ``a, b ≥ 0``).

Nothing here knows a model or a framework: a verl or TRL user passes their own pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

MIN_GAIN = 1.05  # CPU: a larger budget must raise tokens/s by 5 % to be worth its memory
GROWTH = 4  # budgets L, 4L, 16L, ...: the points that cost are the large ones
COST_SHARE = 0.5  # the search may cost this share of the pass's time in one step


@dataclass(frozen=True)
class ProbePoint:
    """One measured pass: ``budget`` tokens in one micro-batch."""

    budget: int
    seconds: float
    memory_gib: float  # peak growth during the pass

    @property
    def tokens_per_s(self) -> float:
        return self.budget / self.seconds


Measure = Callable[[int], ProbePoint]


def series(minimum: int, cap: int, growth: int = GROWTH) -> list[int]:
    """``minimum · growth^k`` below ``cap``, then ``cap`` itself."""
    budgets = [minimum]
    while budgets[-1] * growth < cap:
        budgets.append(budgets[-1] * growth)
    return budgets + ([cap] if cap > budgets[-1] else [])


def fit_memory(points: list[ProbePoint], quadratic: bool) -> list[float]:
    """Least-squares coefficients ``[a, b(, c)]`` of memory_gib ≈ a + b·t (+ c·t²)."""
    degree = min(2 if quadratic else 1, len(points) - 1)
    tokens = torch.tensor([p.budget for p in points], dtype=torch.float64)
    memory = torch.tensor([[p.memory_gib] for p in points], dtype=torch.float64)
    if degree < 1:
        return [float(memory[0, 0]), 0.0]
    powers = torch.stack([tokens**k for k in range(degree + 1)], dim=1)
    return torch.linalg.lstsq(powers, memory).solution[:, 0].tolist()


def predicted_gib(coefficients: list[float], tokens: float) -> float:
    return float(sum(coef * tokens**k for k, coef in enumerate(coefficients)))


def best_rate(points: list[ProbePoint]) -> tuple[ProbePoint, int]:
    """The largest budget that raised tokens/s by ``MIN_GAIN`` over every smaller one, and
    how many larger budgets measured after it did not (its misses)."""
    best, misses = points[0], 0
    for point in points[1:]:
        if point.tokens_per_s >= MIN_GAIN * best.tokens_per_s:
            best, misses = point, 0
        else:
            misses += 1
    return best, misses


def knee(points: list[ProbePoint]) -> ProbePoint | None:
    """The point after which tokens/s stopped rising: the next two budgets both gained less
    than ``MIN_GAIN`` over it (one alone can be a slow measurement: an interrupt, a burst
    of page faults). None until then."""
    best, misses = best_rate(points)
    return best if misses >= 2 else None


def choose(
    points: list[ProbePoint],
    fit: list[float],
    allowance: float,
    cap: int,
    cpu: bool,
    quadratic: bool = False,
) -> int:
    """The largest budget within the allowance; on CPU the best tokens/s (:func:`best_rate`).
    Where the largest point measured fits (and, on CPU, still raised tokens/s), the choice
    goes on past it up to ``cap`` while that point's memory, scaled by tokens (tokens² when
    ``quadratic``) and never below the fit, stays within the allowance. 0: nothing fits."""
    fitting = [p for p in points if p.memory_gib <= allowance]
    if not fitting:
        return 0
    best, misses = best_rate(fitting) if cpu else (fitting[-1], 0)
    if misses or best.budget != points[-1].budget or best.budget >= cap:
        return best.budget
    power = 2 if quadratic else 1

    def bound(tokens: int) -> float:  # an upper bound for a + b·t (+ c·t²), a, b, c ≥ 0
        scaled = best.memory_gib * (tokens / best.budget) ** power
        return max(scaled, predicted_gib(fit, tokens))

    low, high = best.budget, cap + 1  # low is allowed; high is past what may be chosen
    while high - low > 1:  # binary search
        middle = (low + high) // 2
        low, high = (middle, high) if bound(middle) <= allowance else (low, middle)
    return low


def confirm_last_miss(
    points: list[ProbePoint], allowance: float, measure: Measure
) -> list[ProbePoint]:
    """Where the series ended on one miss (the choice would rest on a single slow
    measurement), the best point and that last one are measured once more and keep their
    faster time: on a shared machine noise only slows a pass down. Memory stays the first
    measurement's (made in increasing order; a smaller pass measured after a larger one
    would see the larger one's memory still cached)."""
    fitting = [p for p in points if p.memory_gib <= allowance]
    if len(fitting) < 2 or fitting[-1] is not points[-1]:
        return points
    best, misses = best_rate(fitting)
    if misses != 1:
        return points
    again = {best.budget, points[-1].budget}
    return [
        replace(p, seconds=min(p.seconds, measure(p.budget).seconds)) if p.budget in again else p
        for p in points
    ]


def over_cost(points: list[ProbePoint], next_budget: int, step_tokens: int) -> bool:
    """Whether measuring ``next_budget`` too would make the search cost more than
    ``COST_SHARE`` of what the pass takes in one step of ``step_tokens`` tokens (at the best
    tokens/s seen): the search then costs about half a step, a twentieth of ten."""
    spent = sum(p.seconds for p in points)
    best = max(p.tokens_per_s for p in points)
    return spent + next_budget / points[-1].tokens_per_s > COST_SHARE * step_tokens / best


def search_budget(
    measure: Measure,
    *,
    minimum: int,
    cap: int,
    allowance: float,
    step_tokens: int,
    cpu: bool = True,
    quadratic: bool = False,
) -> dict[str, Any]:
    """Measure the pass over :func:`series` ``(minimum, cap)`` and choose its budget.

    Args:
        measure: ``measure(budget)`` runs the pass once on ``budget`` tokens (full-length
            sequences of ``minimum`` tokens each) and returns its :class:`ProbePoint`.
        minimum: one sequence of full length (L): no budget goes below it.
        cap: the most tokens one micro-batch of the pass can hold.
        allowance: GiB the pass may add to what is in use.
        step_tokens: tokens the pass handles in one training step (the search's cost bound).
        cpu: choose by tokens/s as well as memory (on a GPU, memory alone).
        quadratic: memory grows with tokens² (dense-mask attention).

    Returns:
        ``{"chosen": budget or 0 when even ``minimum`` does not fit, "fit_gib": [a, b(, c)],
        "cap": cap, "points": [ProbePoint as dict, ...]}``.
    """
    points: list[ProbePoint] = []
    budgets = series(minimum, cap)
    for k, budget in enumerate(budgets):
        points.append(measure(budget))
        if points[-1].memory_gib > allowance:
            break
        if cpu and knee(points) is not None:
            break  # tokens/s stopped rising by MIN_GAIN: larger budgets are not worth it
        if k + 1 < len(budgets) and over_cost(points, budgets[k + 1], step_tokens):
            break
    if cpu:
        points = confirm_last_miss(points, allowance, measure)
    fit = fit_memory(points, quadratic)
    return {
        "chosen": choose(points, fit, allowance, cap, cpu, quadratic),
        "fit_gib": fit,
        "cap": cap,
        "points": [asdict(p) for p in points],
    }
