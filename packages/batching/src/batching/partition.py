"""Balanced k-way partitioning by the Karmarkar–Karp largest differencing method.

Each item starts as a *state*: k subsets, one holding the item. Repeatedly the two states
with the largest spread (max − min subset sum) are merged by pairing the heaviest
subset of one with the lightest of the other, which cancels their differences. Greedy
LPT ("give the next item to the lightest bin") is faster but leaves larger gaps on
heavy-tailed length distributions; KK is the method verl uses for the same job.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from batching._inputs import as_workloads

# A subset is (−sum, uid, members); sorting a list of them puts the heaviest first and
# never compares members (uids are unique). Members are a binary tree of index lists
# (leaf: list, node: (left, right)) so a merge costs O(1) instead of a list copy.
# A state holds only its non-empty subsets; the other k − len(state) are empty (sum 0).
_Subset = tuple[float, int, object]
_State = list[_Subset]


def _initial_states(values: list[float], k: int, equal_size: bool) -> list[_State]:
    # Ascending (workload, index) order makes the result independent of input ties.
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    # With equal_size every initial state gives each subset exactly one item, and merging
    # pairs subsets one to one, so every final subset holds n / k items.
    chunk = k if equal_size else 1
    return [
        sorted((-values[i], i, [i]) for i in order[start : start + chunk])
        for start in range(0, len(order), chunk)
    ]


def _spread(state: _State, k: int) -> float:
    lightest = -state[-1][0] if len(state) == k else 0.0
    return -state[0][0] - lightest


def _merge(a: _State, b: _State, k: int, next_uid: int) -> _State:
    """Pair a's i-th heaviest subset with b's i-th lightest (empty ones included)."""
    p, q = len(a), len(b)
    # a[i] meets b[k-1-i]; both are non-empty only for k - q <= i < p.
    low = max(0, k - q)
    combined = [
        (a[i][0] + b[k - 1 - i][0], next_uid + i, (a[i][2], b[k - 1 - i][2])) for i in range(low, p)
    ]
    untouched = a[: min(p, low)] + b[: min(q, k - p)]
    return sorted(untouched + combined)


def _flatten(members: object) -> list[int]:
    out, stack = [], [members]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            out.extend(node)
        else:
            stack.extend(node)
    return sorted(out)


def balanced_partitions(
    workloads: Sequence[float], k: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Split item indices into k groups with sums as equal as KK can make them.

    Args:
        workloads: ``[n]`` non-negative item weights (token counts, FLOP estimates, ...).
        k: number of groups, 1 ≤ k ≤ n.
        equal_size: every group gets exactly n / k items (data-parallel ranks that must
            run the same number of sequences); needs n % k == 0.

    Returns:
        k lists of indices, each ascending; every index appears exactly once. The result
        depends only on the workloads (deterministic).
    """
    values = as_workloads(workloads)
    n = len(values)
    if not 1 <= k <= n:
        raise ValueError(f"`k` must be between 1 and the number of items ({n}), got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the number of items ({n}) to be divisible by k={k}")
    states = _initial_states(values, k, equal_size)
    heap = [(-_spread(state, k), uid, state) for uid, state in enumerate(states)]
    heapq.heapify(heap)
    uid = n  # subset uids: 0..n-1 were used by the leaves
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = _merge(first, second, k, uid)
        uid += k
        heapq.heappush(heap, (-_spread(merged, k), uid, merged))
        uid += 1
    subsets = heap[0][2]
    # Every index is in some subset, so with k <= n no subset can stay empty.
    return [_flatten(members) for _, _, members in subsets]
