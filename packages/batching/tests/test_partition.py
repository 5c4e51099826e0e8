"""Karmarkar–Karp balanced partitions and data-parallel balancing."""

import itertools
import random

import pytest

from batching import balance_across_ranks, balanced_partitions


def brute_force_best_spread(values, k):
    best = float("inf")
    for labels in itertools.product(range(k), repeat=len(values)):
        if len(set(labels)) < k:
            continue
        sums = [sum(v for v, lab in zip(values, labels, strict=True) if lab == g) for g in range(k)]
        best = min(best, max(sums) - min(sums))
    return best


def spread(parts, values):
    sums = [sum(values[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def test_two_way_hand_example() -> None:
    # KK on [8, 7, 6, 5, 4]: 8−7 → 1; 6−5 → 1; 4−1 → 3; 3−1 → 2. Sums 16 / 14.
    values = [8, 7, 6, 5, 4]
    parts = balanced_partitions(values, 2)
    assert sorted(sum(values[i] for i in p) for p in parts) == [14, 16]
    assert sorted(i for p in parts for i in p) == list(range(5))


@pytest.mark.parametrize("seed", range(30))
def test_every_index_once_and_close_to_optimal(seed: int) -> None:
    rng = random.Random(seed)
    n, k = rng.randint(3, 8), rng.randint(2, 3)
    values = [rng.randint(1, 50) for _ in range(n)]
    parts = balanced_partitions(values, k)
    assert len(parts) == k and all(parts)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p == sorted(p) for p in parts)
    # KK is a heuristic; on small inputs it stays within the largest item of the optimum.
    assert spread(parts, values) <= brute_force_best_spread(values, k) + max(values)


@pytest.mark.parametrize("seed", range(10))
def test_equal_size_gives_equal_counts(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(2, 8)
    values = [rng.randint(1, 4096) for _ in range(k * rng.randint(1, 40))]
    parts = balanced_partitions(values, k, equal_size=True)
    assert {len(p) for p in parts} == {len(values) // k}
    assert sorted(i for p in parts for i in p) == list(range(len(values)))


def test_deterministic_and_order_independent_of_ties() -> None:
    values = [5, 3, 5, 3, 1, 1, 9, 0]
    assert balanced_partitions(values, 3) == balanced_partitions(list(values), 3)


def test_balanced_on_large_input() -> None:
    rng = random.Random(0)
    values = [rng.randint(64, 4096) for _ in range(1024)]
    for k in (2, 16, 128):
        sums = [sum(values[i] for i in p) for p in balanced_partitions(values, k)]
        assert max(sums) - min(sums) <= 64, (k, max(sums) - min(sums))


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 2, 3], 0), {}, "`k` must be between 1 and the number of items \\(3\\), got 0"),
        (([1, 2, 3], 4), {}, "got 4"),
        (([1, 2, 3], 2), {"equal_size": True}, "divisible by k=2"),
        (([1, -2, 3], 2), {}, "`workloads\\[1\\]` = -2.0"),
        (([1, float("nan")], 2), {}, "`workloads\\[1\\]` = nan"),
    ],
)
def test_bad_input(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        balanced_partitions(*args, **kwargs)


def test_balance_across_ranks() -> None:
    rng = random.Random(3)
    lens = [rng.choice([100, 4000]) for _ in range(64)]
    assignment = balance_across_ranks(lens, 4)
    assert [len(r) for r in assignment.ranks] == [16] * 4
    assert sorted(i for r in assignment.ranks for i in r) == list(range(64))
    assert assignment.loads == tuple(sum(lens[i] for i in r) for r in assignment.ranks)
    assert assignment.mean_load == sum(lens) / 4
    # with equal counts the best possible is long sequences spread within one per rank
    longs = [sum(lens[i] == 4000 for i in r) for r in assignment.ranks]
    assert max(longs) - min(longs) <= 1
    assert assignment.imbalance == assignment.max_load / assignment.mean_load
    # contiguous chunks, what you get without balancing, are far worse here
    naive = [sum(lens[r * 16 : (r + 1) * 16]) for r in range(4)]
    assert max(naive) - min(naive) > assignment.max_load - assignment.min_load
    with pytest.raises(ValueError, match="does not split evenly over world_size=5"):
        balance_across_ranks(lens, 5)
