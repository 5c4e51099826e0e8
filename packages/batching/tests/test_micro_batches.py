"""Hard-capped token-budget micro-batches: properties over length distributions, edge cases."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import (
    balanced_partitions,
    first_fit_decreasing_count,
    fixed_size_micro_batches,
    restore_order,
    sequence_workloads,
    token_budget_micro_batches,
)

VERL_COUNTEREXAMPLE = [2030, 1950, 2027, 1991, 139]


def test_verl_counterexample_fits_in_two_micro_batches() -> None:
    # The soft cap (ceil(Σ/budget) = 2 parts, balanced by compute) overshoots: 4116 + 4021.
    soft = balanced_partitions(sequence_workloads(VERL_COUNTEREXAMPLE), 2)
    assert max(sum(VERL_COUNTEREXAMPLE[i] for i in p) for p in soft) == 4116
    plan = token_budget_micro_batches(VERL_COUNTEREXAMPLE, 4096)
    assert len(plan) == 2
    assert sorted(plan.token_sums) == [4057, 4080]  # 2030 + 2027 and 1950 + 1991 + 139


def lengths(distribution: str, n: int, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        lens = rng.integers(1, max_len + 1, n)
    elif distribution == "lognormal":
        lens = np.clip(rng.lognormal(np.log(max_len / 8), 0.9, n), 1, max_len)
    elif distribution == "bimodal":
        short = rng.integers(1, max(2, max_len // 10), n)
        long = rng.integers(max(1, max_len * 7 // 10), max_len + 1, n)
        lens = np.where(rng.random(n) < 0.6, short, long)
    elif distribution == "all-equal":
        lens = np.full(n, rng.integers(1, max_len + 1))
    else:  # one long outlier among short ones
        lens = rng.integers(1, max(2, max_len // 20), n)
        lens[rng.integers(n)] = max_len
    return [int(v) for v in lens]


DISTRIBUTIONS = ["uniform", "lognormal", "bimodal", "all-equal", "outlier"]


@settings(max_examples=150, deadline=None)
@given(
    distribution=st.sampled_from(DISTRIBUTIONS),
    n=st.integers(1, 300),
    max_len=st.integers(1, 2048),
    budget_factor=st.floats(1.0, 6.0),
    workload=st.sampled_from(["tokens", "compute"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_plan_properties(distribution, n, max_len, budget_factor, workload, seed) -> None:
    lens = lengths(distribution, n, max_len, seed)
    budget = max(max(lens), int(max_len * budget_factor))
    plan = token_budget_micro_batches(lens, budget, workload=workload)
    # hard cap, recomputed from the indices, and no empty micro-batch
    sums = [sum(lens[i] for i in mb) for mb in plan.micro_batches]
    assert list(plan.token_sums) == sums
    assert max(sums) <= budget
    assert all(plan.micro_batches)
    # every index exactly once
    assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(n))
    # restore_order undoes the plan, for tensors and lists
    chunks = [torch.tensor(mb) for mb in plan.micro_batches]
    assert restore_order(chunks, plan).tolist() == list(range(n))
    assert restore_order([list(mb) for mb in plan.micro_batches], plan) == list(range(n))
    # minimal among the counts tried: every smaller count from the lower bound failed
    lower = math.ceil(sum(lens) / budget)
    for k in range(max(lower, 1), len(plan)):
        with pytest.raises(ValueError, match="cannot split"):
            token_budget_micro_batches(lens, budget, num_micro_batches=k, workload=workload)
    assert len(plan) <= first_fit_decreasing_count(lens, budget)


@pytest.mark.parametrize("distribution", ["uniform", "lognormal", "bimodal"])
def test_loads_are_balanced_at_scale(distribution: str) -> None:
    lens = lengths(distribution, 1024, 4096, seed=0)
    plan = token_budget_micro_batches(lens, 16384, workload="tokens")
    assert len(plan) == math.ceil(sum(lens) / 16384)  # the lower bound is reached here
    assert max(plan.token_sums) / (sum(lens) / len(plan)) < 1.05


def test_forced_count_respects_the_cap_and_spreads_work() -> None:
    lens = [100] * 8
    plan = token_budget_micro_batches(lens, 400, num_micro_batches=4)
    assert plan.token_sums == (200, 200, 200, 200)
    with pytest.raises(ValueError, match="cannot split 8 sequences \\(800 tokens\\) into 1"):
        token_budget_micro_batches(lens, 400, num_micro_batches=1)
    with pytest.raises(ValueError, match="between 1 and the number of sequences \\(8\\)"):
        token_budget_micro_batches(lens, 400, num_micro_batches=9)


def test_min_num_micro_batches() -> None:
    plan = token_budget_micro_batches([10, 10, 10, 10], 1000, min_num_micro_batches=2)
    assert len(plan) == 2 and plan.token_sums == (20, 20)


def test_accepts_tensors_and_arrays() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    from_tensor = token_budget_micro_batches(mask.sum(-1), 5)
    assert from_tensor == token_budget_micro_batches(np.array([3, 2, 4]), 5)
    assert sorted(from_tensor.token_sums) == [4, 5]


@pytest.mark.parametrize(
    ("lens", "budget", "kwargs", "match"),
    [
        ([10, 5000, 20], 4096, {}, "sequence 1 has 5000 tokens, more than .* max_tokens=4096"),
        ([], 4096, {}, "`seq_lens` is empty"),
        ([10, -1], 4096, {}, "`seq_lens\\[1\\]` = -1 is negative"),
        ([10], 0, {}, "`max_tokens` must be >= 1"),
        ([10], 100, {"workload": "flops"}, "unknown workload 'flops'; valid: tokens, compute"),
        ([10, 10], 100, {"min_num_micro_batches": 3}, "min_num_micro_batches=3 exceeds the 2"),
    ],
)
def test_bad_input(lens, budget, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        token_budget_micro_batches(lens, budget, **kwargs)


def test_restore_order_checks_chunks() -> None:
    plan = token_budget_micro_batches([3, 3, 3], 6)
    with pytest.raises(ValueError, match="got 1 chunks for a plan of 2 micro-batches"):
        restore_order([torch.zeros(3)], plan)
    with pytest.raises(ValueError, match="chunk 0 has 5 rows"):
        restore_order([torch.zeros(5), torch.zeros(1)], plan)


def test_fixed_size_micro_batches_are_consecutive_chunks_whatever_the_lengths() -> None:
    lens = [5, 100, 7, 3, 50]
    plan = fixed_size_micro_batches(lens, 2)
    assert plan.micro_batches == ((0, 1), (2, 3), (4,))
    assert plan.token_sums == (105, 10, 50) and plan.max_tokens == 105
    outputs = [torch.tensor(list(mb)) for mb in plan.micro_batches]
    assert restore_order(outputs, plan).tolist() == [0, 1, 2, 3, 4]
    assert fixed_size_micro_batches(lens, 8).micro_batches == ((0, 1, 2, 3, 4),)
    with pytest.raises(ValueError, match="micro_batch_size"):
        fixed_size_micro_batches(lens, 0)
