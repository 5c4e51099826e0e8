"""batching.search_budget and its parts, over synthetic measurements (no model, no app)."""

import pytest

from batching import ProbePoint, search_budget
from batching.budget_search import choose, confirm_last_miss, fit_memory, knee, series


def test_series_fit_and_choice() -> None:
    assert series(10, 200) == [10, 40, 160, 200] and series(10, 160) == [10, 40, 160]
    assert series(10, 80, growth=2) == [10, 20, 40, 80] and series(10, 10) == [10]
    rates = ((100, 50), (200, 90), (400, 93), (800, 91))  # tokens/s rising, then flat twice
    points = [ProbePoint(b, b / r, 0.5 + 0.001 * b) for b, r in rates]
    assert knee(points).budget == 200 and knee(points[:3]) is None  # one miss is not a knee
    assert knee([points[0], ProbePoint(200, 200 / 40, 0), *points[1:]]).budget == 200
    a, b = fit_memory(points, quadratic=False)
    assert a == pytest.approx(0.5) and b == pytest.approx(0.001)
    # CPU: 200 still gains 80 %, 400 and 800 only 3 % and 1 %: the knee is 200
    assert choose(points, [a, b], allowance=10.0, cap=800, cpu=True) == 200
    # memory: 400 tokens would need 0.9 GiB
    assert choose(points, [a, b], allowance=0.8, cap=800, cpu=False) == 200
    points = points[:3]
    # CPU, the last point measured gained < 5 % (one miss, then the probe stopped): not
    # rising, so the fit does not carry it on
    assert choose(points, [a, b], allowance=10.0, cap=1000, cpu=True) == 200
    # CUDA: everything measured fits, so the choice goes on past 400 tokens (0.9 GiB) while
    # that memory scaled by tokens fits (1.05 GiB at 466 tokens; the fit alone would say
    # 550), or up to the cap
    assert choose(points, [a, b], allowance=1.05, cap=10_000, cpu=False) == 466
    assert choose(points, [a, b], allowance=1.05, cap=450, cpu=False) == 450
    # dense masks: scaled by tokens² (0.9 · (t / 400)² ≤ 1.05 up to 432 tokens)
    assert choose(points, [a, b], allowance=1.05, cap=10_000, cpu=False, quadratic=True) == 432
    # the fit bounds it from below where it predicts more than the scaled point
    assert choose(points, [0.0, 0.01], allowance=1.05, cap=10_000, cpu=False) == 400
    assert choose(points, [a, b], allowance=0.1, cap=400, cpu=True) == 0  # nothing fits
    # CPU, still rising at the last point measured (the probe stopped for its cost): the
    # choice goes on up to the cap (or the allowance: 0.7 GiB at 200 → 0.875 at 250)
    rising = points[:2]
    assert choose(rising, [a, b], allowance=10.0, cap=1000, cpu=True) == 1000
    assert choose(rising, [a, b], allowance=0.875, cap=1000, cpu=True) == 250


def test_a_series_that_ends_on_one_miss_is_measured_again() -> None:
    rates = {100: 50.0, 400: 90.0, 1600: 92.0}  # 1600 gained 2 %: one miss, the last point
    points = [ProbePoint(b, b / r, 0.001 * b) for b, r in rates.items()]
    asked: list[int] = []

    def measure(budget: int) -> ProbePoint:  # the second time, 1600 runs at 130 tokens/s
        asked.append(budget)
        return ProbePoint(budget, budget / {400: 85.0, 1600: 130.0}[budget], 99.0)

    again = confirm_last_miss(points, 10.0, measure)
    assert sorted(asked) == [400, 1600]  # the best point and the miss, once each
    assert [p.tokens_per_s for p in again] == pytest.approx([50.0, 90.0, 130.0])  # faster kept
    assert [p.memory_gib for p in again] == [p.memory_gib for p in points]  # first memory
    assert choose(again, [0.0, 0.001], allowance=10.0, cap=6400, cpu=True) == 6400
    assert choose(points, [0.0, 0.001], allowance=10.0, cap=6400, cpu=True) == 400
    # still rising, two misses (a knee), or the miss over the allowance: nothing to confirm
    asked.clear()
    for unchanged, allowance in ((points[:2], 10.0), ([*points, points[-1]], 10.0), (points, 1.0)):
        assert confirm_last_miss(unchanged, allowance, measure) == unchanged
    assert asked == []


class Pass:
    """A synthetic pass: tokens/s rises with the budget up to ``knee_at`` and is flat after
    it; memory is ``base + per_token · tokens``. Records every budget it was asked for."""

    def __init__(self, knee_at: int, base: float = 0.2, per_token: float = 1e-3) -> None:
        self.knee_at, self.base, self.per_token = knee_at, base, per_token
        self.asked: list[int] = []

    def __call__(self, budget: int) -> ProbePoint:
        self.asked.append(budget)
        rate = 100.0 * min(budget, self.knee_at) ** 0.5
        return ProbePoint(budget, budget / rate, self.base + self.per_token * budget)


def test_search_stops_at_the_knee_on_cpu() -> None:
    measure = Pass(knee_at=160)
    found = search_budget(
        measure, minimum=10, cap=100_000, allowance=1e9, step_tokens=10**9, cpu=True
    )
    # 10, 40, 160 rise; 640 and 2560 do not (two misses: the knee), nothing past them
    assert measure.asked == [10, 40, 160, 640, 2560]
    assert found["chosen"] == 160 and found["cap"] == 100_000
    assert [p["budget"] for p in found["points"]] == [10, 40, 160, 640, 2560]
    assert found["fit_gib"] == pytest.approx([0.2, 1e-3])


def test_search_on_gpu_takes_the_largest_budget_memory_allows() -> None:
    measure = Pass(knee_at=10)  # flat tokens/s: only memory decides on a GPU
    found = search_budget(
        measure, minimum=10, cap=10_000, allowance=3.0, step_tokens=10**9, cpu=False
    )
    # the series ends at the cap (10_000 tokens: 10.2 GiB, over the allowance); 2560 tokens
    # (2.76 GiB) is the largest that fits, and it is not the last point measured: chosen
    assert measure.asked == [10, 40, 160, 640, 2560, 10_000]
    assert found["chosen"] == 2560


def test_search_stops_where_measuring_would_cost_more_than_half_a_step() -> None:
    measure = Pass(knee_at=10**6)  # still rising at every budget
    # the pass handles 200 tokens per step: measuring 160 after 10 and 40 costs too much
    found = search_budget(measure, minimum=10, cap=10_000, allowance=1e9, step_tokens=200)
    assert measure.asked == [10, 40]
    assert found["chosen"] == 10_000  # still rising, memory allows: on up to the cap


def test_search_returns_zero_when_one_sequence_does_not_fit() -> None:
    measure = Pass(knee_at=100, base=5.0)
    found = search_budget(measure, minimum=10, cap=1000, allowance=1.0, step_tokens=10**6)
    assert found["chosen"] == 0 and measure.asked == [10]
