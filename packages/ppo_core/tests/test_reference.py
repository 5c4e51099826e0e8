"""Every public ``ppo_core`` function against its pure-Python reference (``reference.py``).

Inputs are random float64 tensors over many seeds and shapes (B 1..8, T 1..12), with
masks that mix all-masked rows, fully valid rows, right-padded rows and rows with masked
tokens between valid ones, so the tolerances can be tight (1e-10). A few hand-computed
cases pin the references themselves to the specification, and hypothesis property tests
cover k3 ≥ 0, GAE returns as reward-to-go, and the KL controllers.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ppo_core
from ppo_core import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
)


def _load_reference():
    # pytest runs with --import-mode=importlib, so this directory is not on sys.path;
    # load the sibling module under a name no other package's tests can shadow.
    name = "ppo_core_tests_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("reference.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ref = _load_reference()

SEEDS = list(range(20))
TOL = {"rtol": 1e-10, "atol": 1e-10}
MASK_KINDS = ("empty", "full", "prefix", "interior")


# --------------------------------------------------------------------------------------
# input generation
# --------------------------------------------------------------------------------------


def _row_mask(rng: random.Random, kind: str, length: int) -> list[int]:
    if kind == "empty":
        return [0] * length
    if kind == "full":
        return [1] * length
    if kind == "prefix":  # right padding
        n = rng.randint(1, length)
        return [1] * n + [0] * (length - n)
    # interior: valid tokens with masked ones (observation/tool tokens) between them
    row = [rng.randint(0, 1) for _ in range(length)]
    if length >= 3:
        i = rng.randrange(0, length - 2)
        row[i], row[i + 1], row[i + 2] = 1, 0, 1
    elif sum(row) == 0:
        row[0] = 1
    return row


def make_mask(rng: random.Random, batch: int, length: int, dtype=None) -> torch.Tensor:
    """[B, T] mask; for B >= 4 every row kind appears at least once."""
    kinds = [MASK_KINDS[i % len(MASK_KINDS)] for i in range(batch)]
    rng.shuffle(kinds)
    rows = [_row_mask(rng, kind, length) for kind in kinds]
    if dtype is None:
        dtype = rng.choice([torch.bool, torch.float64])
    return torch.tensor(rows, dtype=dtype)


def make_case(seed: int, min_b: int = 1, min_t: int = 1):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, length = rng.randint(min_b, 8), rng.randint(min_t, 12)
    return rng, gen, batch, length


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def assert_tensor(actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.to(torch.float64), expected, **(tol or TOL))


def assert_float(actual, expected: float, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    actual = float(actual)
    assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol), (actual, expected)


def both(fn, ref_fn, *args, **kwargs):
    """Call both; either both raise ValueError (returns None) or return both results."""
    try:
        expected = ref_fn(*args, **kwargs)
    except ValueError:
        with pytest.raises(ValueError):
            fn(*args, **kwargs)
        return None
    return fn(*args, **kwargs), expected


# --------------------------------------------------------------------------------------
# masked ops
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_sum_and_mean(seed):
    rng, gen, batch, length = make_case(seed)
    x = randn(gen, batch, length, scale=3.0)
    mask = make_mask(rng, batch, length)
    for dim in (None, 0, 1, -1):
        assert_tensor(ppo_core.masked_sum(x, mask, dim), ref.ref_masked_sum(x, mask, dim))
        assert_tensor(ppo_core.masked_mean(x, mask, dim), ref.ref_masked_mean(x, mask, dim))
    # 3-D and 1-D inputs, reductions over every dimension
    extra = rng.randint(1, 4)
    x3 = randn(gen, batch, extra, length)
    m3 = torch.stack([make_mask(rng, batch, length, torch.float64) for _ in range(extra)], dim=1)
    for dim in (None, 0, 1, 2, -2):
        assert_tensor(ppo_core.masked_sum(x3, m3, dim), ref.ref_masked_sum(x3, m3, dim))
        assert_tensor(ppo_core.masked_mean(x3, m3, dim), ref.ref_masked_mean(x3, m3, dim))
    x1, m1 = x[0], mask[0]
    for dim in (None, 0):
        assert_tensor(ppo_core.masked_mean(x1, m1, dim), ref.ref_masked_mean(x1, m1, dim))


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_var_and_whiten(seed):
    rng, gen, batch, length = make_case(seed)
    x = randn(gen, batch, length, scale=2.0) + rng.uniform(-5, 5)
    mask = make_mask(rng, batch, length)
    # the biased variance is defined for any mask
    assert_tensor(
        ppo_core.masked_var(x, mask, unbiased=False), ref.ref_masked_var(x, mask, unbiased=False)
    )
    for m in (mask, torch.zeros_like(mask), make_mask(rng, batch, length)):
        res = both(ppo_core.masked_var, ref.ref_masked_var, x, m, unbiased=True)
        if res is not None:
            assert_tensor(*res)
        for shift_mean in (True, False):
            res = both(ppo_core.masked_whiten, ref.ref_masked_whiten, x, m, shift_mean=shift_mean)
            if res is not None:
                assert_tensor(*res)


def test_masked_var_needs_two_entries():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    one = torch.tensor([0, 1, 0])
    with pytest.raises(ValueError):
        ref.ref_masked_var(x, one)
    with pytest.raises(ValueError):
        ppo_core.masked_var(x, one)
    with pytest.raises(ValueError):
        ppo_core.masked_whiten(x, one)
    assert_float(ppo_core.masked_var(x, one, unbiased=False), 0.0)


# --------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_and_entropy(seed):
    rng, gen, batch, length = make_case(seed)
    vocab = rng.randint(1, 40)
    logits = randn(gen, batch, length, vocab, scale=rng.uniform(0.5, 8.0))
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    temperature = rng.choice([1.0, rng.uniform(0.3, 2.5)])

    out = ppo_core.logprobs_from_logits(logits, labels, temperature)
    assert out.dtype == torch.float64
    assert_tensor(out, ref.ref_logprobs_from_logits(logits, labels, temperature))
    ent = ppo_core.entropy_from_logits(logits)
    assert ent.dtype == torch.float64
    assert_tensor(ent, ref.ref_entropy_from_logits(logits))

    # any leading shape
    flat_out = ppo_core.logprobs_from_logits(logits.reshape(-1, vocab), labels.reshape(-1))
    assert_tensor(
        flat_out, ref.ref_logprobs_from_logits(logits.reshape(-1, vocab), labels.reshape(-1))
    )

    # bf16 logits: computed in float32, compared with the exact log-softmax of the
    # bf16-rounded values (the reference reads them with .tolist(), no further rounding)
    bf16 = logits.to(torch.bfloat16)
    out16 = ppo_core.logprobs_from_logits(bf16, labels, temperature)
    assert out16.dtype == torch.float32
    loose = {"rtol": 1e-5, "atol": 1e-5}
    assert_tensor(out16, ref.ref_logprobs_from_logits(bf16, labels, temperature), **loose)
    ent16 = ppo_core.entropy_from_logits(bf16)
    assert ent16.dtype == torch.float32
    assert_tensor(ent16, ref.ref_entropy_from_logits(bf16), **loose)


def test_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)
    labels = torch.tensor([[1]])
    # softmax = [1/4, 3/4]
    assert_float(ref.ref_logprobs_from_logits(logits, labels).item(), math.log(0.75))
    assert_float(ppo_core.logprobs_from_logits(logits, labels).item(), math.log(0.75))
    # τ = 2: z/τ = [0, log √3] -> p = √3 / (1 + √3)
    p = math.sqrt(3.0) / (1 + math.sqrt(3.0))
    assert_float(ref.ref_logprobs_from_logits(logits, labels, 2.0).item(), math.log(p))
    uniform = torch.zeros(1, 1, 5, dtype=torch.float64)
    assert_float(ref.ref_entropy_from_logits(uniform).item(), math.log(5.0))
    assert_float(ppo_core.entropy_from_logits(uniform).item(), math.log(5.0))


# --------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------


def _logprob_pair(rng, gen, batch, length):
    old = -randn(gen, batch, length).abs() * 2
    ref_lp = old + randn(gen, batch, length, scale=rng.uniform(0.05, 2.0))
    # a few far-apart tokens exercise the ±20 / ±10 clamps of k3
    far = torch.rand(batch, length, generator=gen) < 0.15
    ref_lp = torch.where(far, old + randn(gen, batch, length, scale=30.0), ref_lp)
    return old, ref_lp


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_penalty(seed):
    rng, gen, batch, length = make_case(seed)
    logprob, ref_logprob = _logprob_pair(rng, gen, batch, length)
    for estimator in KL_ESTIMATORS:
        assert_tensor(
            ppo_core.kl_penalty(logprob, ref_logprob, estimator),
            ref.ref_kl_penalty(logprob, ref_logprob, estimator),
        )


def test_kl_estimator_names():
    assert set(KL_ESTIMATORS) == {
        n + s for n in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl") for s in ("", "+")
    }
    x = torch.zeros(2, 3, dtype=torch.float64)
    for bad in ("k4", "K1", "", "+", "k3++", "low_var"):
        with pytest.raises(ValueError):
            ppo_core.kl_penalty(x, x, bad)
        with pytest.raises(ValueError):
            ref.ref_kl_penalty(x, x, bad)


def test_kl_penalty_hand_computed():
    logprob = torch.tensor([[-1.0, -2.0, 0.0, -40.0]], dtype=torch.float64)
    ref_lp = torch.tensor([[-2.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    # Δ = [1, -1, 0, -40]
    expect = {
        "k1": [1.0, -1.0, 0.0, -40.0],
        "abs": [1.0, 1.0, 0.0, 40.0],
        "k2": [0.5, 0.5, 0.0, 800.0],
        # κ = -Δ clamped to [-20, 20]: e^κ - κ - 1, clamped to [-10, 10]
        "k3": [math.exp(-1.0), math.exp(1.0) - 2.0, 0.0, 10.0],
    }
    for name, values in expect.items():
        want = torch.tensor([values], dtype=torch.float64)
        assert_tensor(ref.ref_kl_penalty(logprob, ref_lp, name), want)
        assert_tensor(ppo_core.kl_penalty(logprob, ref_lp, name), want)


@pytest.mark.parametrize("seed", SEEDS)
def test_apply_kl_penalty(seed):
    rng, gen, batch, length = make_case(seed)
    old, ref_lp = _logprob_pair(rng, gen, batch, length)
    mask = make_mask(rng, batch, length)
    scores = randn(gen, batch, length)
    estimator = rng.choice(KL_ESTIMATORS)
    beta = rng.uniform(0.0, 0.5)
    kl_coef = rng.choice([beta, torch.tensor(beta, dtype=torch.float64)])
    rewards, metrics = ppo_core.apply_kl_penalty(scores, old, ref_lp, mask, kl_coef, estimator)
    want_rewards, want_kl = ref.ref_apply_kl_penalty(scores, old, ref_lp, mask, kl_coef, estimator)
    assert_tensor(rewards, want_rewards)
    assert_float(metrics["kl"], want_kl)
    assert_float(metrics["kl_coef"], beta)


def test_apply_kl_penalty_hand_computed():
    scores = torch.tensor([[0.0, 1.0], [5.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    ref_lp = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 0]])
    # k1 = [1, 3] on row 0; row 1 is all-masked: KL 0 there, and it counts in the mean
    want_rewards = [[-0.5, -0.5], [5.0, 5.0]]
    want_kl = (4.0 / (2.0 + 1e-8) + 0.0) / 2.0
    got, kl = ref.ref_apply_kl_penalty(scores, old, ref_lp, mask, 0.5)
    assert got.tolist() == want_rewards
    assert_float(kl, want_kl)
    got, metrics = ppo_core.apply_kl_penalty(scores, old, ref_lp, mask, 0.5)
    assert got.tolist() == want_rewards
    assert_float(metrics["kl"], want_kl)


# --------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_compute_gae(seed):
    rng, gen, batch, length = make_case(seed)
    rewards = randn(gen, batch, length)
    values = randn(gen, batch, length)
    mask = make_mask(rng, batch, length)
    gamma, lam = rng.choice([1.0, rng.uniform(0.5, 1.0)]), rng.choice([1.0, rng.uniform(0.5, 1.0)])
    res = both(ppo_core.compute_gae, ref.ref_compute_gae, rewards, values, mask, gamma, lam)
    if res is None:
        assert mask.to(torch.float64).sum() < 2
        return
    (adv, ret), (want_adv, want_ret) = res
    assert_tensor(ret, want_ret)
    assert_tensor(adv, want_adv)


def test_compute_gae_hand_computed():
    # γ = 0.5, λ = 1; token 1 is an observation token (masked)
    r = torch.tensor([[1.0, 100.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 100.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1]])
    # t=2: δ = 2 - 1 = 1, A = 1; t=1 (masked): A = 1, carried; t=0: δ = 1 + 0.5·1 - 0.5 = 1,
    # A = 1 + 0.5·1 = 1.5.  returns = A + V = [2, 101, 2]
    want_ret = torch.tensor([[2.0, 101.0, 2.0]], dtype=torch.float64)
    _, ret = ref.ref_compute_gae(r, v, m, 0.5, 1.0)
    assert_tensor(ret, want_ret)
    _, ret = ppo_core.compute_gae(r, v, m, 0.5, 1.0)
    assert_tensor(ret, want_ret)


def _group_ids(rng: random.Random, batch: int):
    num_groups = rng.randint(1, batch)
    ints = [rng.randrange(num_groups) * 7 - 3 for _ in range(batch)]  # sparse, negative ok
    kind = rng.choice(["tensor", "str", "int"])
    if kind == "tensor":
        return torch.tensor(ints)
    if kind == "str":
        return [f"prompt-{i}" for i in ints]
    return ints


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_and_rloo(seed):
    rng, gen, batch, length = make_case(seed)
    scores = randn(gen, batch)
    if rng.random() < 0.3:  # binary rewards give groups with zero std
        scores = (scores > 0).to(torch.float64)
    group_ids = _group_ids(rng, batch)
    mask = make_mask(rng, batch, length)
    for norm_by_std in (True, False):
        eps = rng.choice([1e-6, 1e-3])
        adv, ret = ppo_core.compute_grpo_advantages(scores, group_ids, mask, norm_by_std, eps)
        want_adv, want_ret = ref.ref_compute_grpo_advantages(
            scores, group_ids, mask, norm_by_std, eps
        )
        assert_tensor(adv, want_adv, rtol=1e-10, atol=1e-9)
        assert_tensor(ret, want_ret, rtol=1e-10, atol=1e-9)
    adv, ret = ppo_core.compute_rloo_advantages(scores, group_ids, mask)
    want_adv, want_ret = ref.ref_compute_rloo_advantages(scores, group_ids, mask)
    assert_tensor(adv, want_adv)
    assert_tensor(ret, want_ret)


def test_grpo_rloo_hand_computed():
    scores = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    ids = ["a", "a", "b", "c"]
    mask = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1]])
    # group a: mean 2, unbiased std √2; b and c are singletons: mean 0, std 1
    s2 = math.sqrt(2.0)
    grpo = [-1 / (s2 + 1e-6), 1 / (s2 + 1e-6), 5 / (1 + 1e-6), 7 / (1 + 1e-6)]
    want = torch.tensor(
        [[a * m for m in row] for a, row in zip(grpo, mask.tolist(), strict=True)],
        dtype=torch.float64,
    )
    assert_tensor(ref.ref_compute_grpo_advantages(scores, ids, mask)[0], want)
    assert_tensor(ppo_core.compute_grpo_advantages(scores, ids, mask)[0], want)
    rloo = [1.0 - 3.0, 3.0 - 1.0, 5.0, 7.0]
    want = torch.tensor(
        [[a * m for m in row] for a, row in zip(rloo, mask.tolist(), strict=True)],
        dtype=torch.float64,
    )
    assert_tensor(ref.ref_compute_rloo_advantages(scores, ids, mask)[0], want)
    assert_tensor(ppo_core.compute_rloo_advantages(scores, ids, mask)[0], want)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp(seed):
    rng, gen, batch, length = make_case(seed)
    rewards = randn(gen, batch, length)
    mask = make_mask(rng, batch, length)
    gamma = rng.choice([1.0, rng.uniform(0.5, 1.0)])
    res = both(
        ppo_core.compute_reinforce_pp_advantages,
        ref.ref_compute_reinforce_pp_advantages,
        rewards,
        mask,
        gamma,
    )
    if res is None:
        assert mask.to(torch.float64).sum() < 2
        return
    (adv, ret), (want_adv, want_ret) = res
    assert_tensor(ret, want_ret)
    assert_tensor(adv, want_adv)


def test_reinforce_pp_hand_computed():
    r = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1, 1]])
    # γ = 0.5: G3 = 8, G2 = 4 + 4 = 8, G1 = 2 + 0.5·8 = 6 (then reset by m1 = 0), G0 = 1
    want = torch.tensor([[1.0, 6.0, 8.0, 8.0]], dtype=torch.float64)
    assert_tensor(ref.ref_compute_reinforce_pp_advantages(r, m, 0.5)[1], want)
    assert_tensor(ppo_core.compute_reinforce_pp_advantages(r, m, 0.5)[1], want)


# --------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------


def _global_counts(rng: random.Random, mask: torch.Tensor, mode: str) -> dict:
    """Random global normalizers (>= the local count), dp_size and loss_scale_factor."""
    kwargs: dict = {}
    if rng.random() < 0.5:
        dp_size = rng.randint(1, 4)
        m = mask.to(torch.float64)
        if mode == "token-mean":
            local = int(m.sum())
            key = "global_num_tokens"
        else:
            local = int((m.sum(dim=-1) > 0).sum())
            key = "global_num_seqs"
        count = max(1, local + rng.randint(0, 20))
        kwargs[key] = rng.choice([count, float(count), torch.tensor(count)])
        kwargs["dp_size"] = dp_size
    if mode == "seq-mean-token-sum-norm" and rng.random() < 0.5:
        kwargs["loss_scale_factor"] = rng.uniform(1.0, 64.0)
    return kwargs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss(seed, mode):
    rng, gen, batch, length = make_case(seed)
    loss_mat = randn(gen, batch, length, scale=2.0)
    mask = make_mask(rng, batch, length)
    kwargs = _global_counts(rng, mask, mode)
    got = ppo_core.aggregate_loss(loss_mat, mask, mode, **kwargs)
    assert got.dim() == 0
    assert_float(got, ref.ref_aggregate_loss(loss_mat, mask, mode, **kwargs))
    # with no valid token at all the loss is 0 in every mode
    empty = torch.zeros_like(mask)
    assert_float(ppo_core.aggregate_loss(loss_mat, empty, mode), 0.0)
    assert_float(ref.ref_aggregate_loss(loss_mat, empty, mode), 0.0)


def test_aggregate_loss_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    # valid rows 0 and 2: token sums 3 and 16, counts 2 and 2; 4 valid tokens
    cases = {
        ("token-mean", ()): 19.0 / (4.0 + 1e-8),
        ("token-mean", (("global_num_tokens", 10), ("dp_size", 2))): 19.0 / 10.0 * 2,
        ("seq-mean-token-sum", ()): (3.0 + 16.0) / 2,
        ("seq-mean-token-mean", ()): (1.5 + 8.0) / 2,
        ("seq-mean-token-sum-norm", ()): (3.0 / 3 + 16.0 / 3) / 2,
        ("seq-mean-token-sum-norm", (("loss_scale_factor", 4.0),)): (3.0 / 4 + 16.0 / 4) / 2,
        ("seq-mean-token-sum", (("global_num_seqs", 5), ("dp_size", 3))): 19.0 / 5 * 3,
    }
    for (mode, kw), want in cases.items():
        kwargs = dict(kw)
        assert_float(ref.ref_aggregate_loss(loss, mask, mode, **kwargs), want)
        assert_float(ppo_core.aggregate_loss(loss, mask, mode, **kwargs), want)


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_loss(seed):
    rng, gen, batch, length = make_case(seed)
    old = -randn(gen, batch, length).abs() * 2
    logprob = old + randn(gen, batch, length, scale=rng.uniform(0.05, 0.8))
    far = torch.rand(batch, length, generator=gen) < 0.1  # exercises the ±20 clamp
    logprob = torch.where(far, old + randn(gen, batch, length, scale=30.0), logprob)
    advantages = randn(gen, batch, length)
    advantages = torch.where(torch.rand(batch, length, generator=gen) < 0.1, 0.0, advantages)
    mask = make_mask(rng, batch, length)
    for mode in LOSS_AGG_MODES:
        kwargs = _global_counts(rng, mask, mode)
        kwargs["clip_ratio_low"] = rng.uniform(0.05, 0.4)
        kwargs["clip_ratio_high"] = rng.uniform(0.05, 0.4)
        kwargs["clip_ratio_c"] = rng.choice([3.0, rng.uniform(1.05, 10.0), None])
        loss, metrics = ppo_core.policy_loss(
            logprob, old, advantages, mask, agg_mode=mode, **kwargs
        )
        want_loss, want_metrics = ref.ref_policy_loss(
            logprob, old, advantages, mask, agg_mode=mode, **kwargs
        )
        assert_float(loss, want_loss, rtol=1e-10, atol=1e-9)
        assert set(metrics) == set(want_metrics)
        for key, want in want_metrics.items():
            assert_float(metrics[key], want, rtol=1e-10, atol=1e-9)
    # defaults
    loss, metrics = ppo_core.policy_loss(logprob, old, advantages, mask)
    want_loss, want_metrics = ref.ref_policy_loss(logprob, old, advantages, mask)
    assert_float(loss, want_loss, rtol=1e-10, atol=1e-9)
    for key, want in want_metrics.items():
        assert_float(metrics[key], want, rtol=1e-10, atol=1e-9)


def test_policy_loss_hand_computed():
    # ρ = e^d; ε = 0.2, c = 3
    d = [math.log(1.5), math.log(0.5), math.log(10.0), math.log(1.1)]
    old = torch.zeros(1, 4, dtype=torch.float64)
    logprob = torch.tensor([d], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    # A=1, ρ=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A=-1, ρ=0.5: max(0.5, 0.8) = 0.8 (clipped), below c·|A| = 3
    # A=-1, ρ=10: max(10, 1.2) = 10 -> dual clip to 3
    # A=2, ρ=1.1: max(-2.2, -2.2) = -2.2, no clip
    per_token = [-1.2, 0.8, 3.0, -2.2]
    want_loss = sum(per_token) / (4 + 1e-8)
    for fn in (ref.ref_policy_loss, ppo_core.policy_loss):
        loss, metrics = fn(logprob, old, adv, mask)
        assert_float(loss, want_loss, atol=1e-12)
        assert_float(metrics["pg_clipfrac"], 2 / (4 + 1e-8))
        assert_float(metrics["pg_clipfrac_lower"], 1 / (4 + 1e-8))
        assert_float(metrics["ppo_kl"], -sum(d) / (4 + 1e-8))


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss(seed):
    rng, gen, batch, length = make_case(seed)
    returns = randn(gen, batch, length, scale=2.0)
    old_values = returns + randn(gen, batch, length)
    values = old_values + randn(gen, batch, length, scale=rng.uniform(0.1, 1.5))
    mask = make_mask(rng, batch, length)
    for mode in LOSS_AGG_MODES:
        kwargs = _global_counts(rng, mask, mode)
        kwargs["clip_range"] = rng.uniform(0.05, 1.0)
        loss, metrics = ppo_core.value_loss(
            values, old_values, returns, mask, agg_mode=mode, **kwargs
        )
        want_loss, want_metrics = ref.ref_value_loss(
            values, old_values, returns, mask, agg_mode=mode, **kwargs
        )
        assert_float(loss, want_loss)
        assert set(metrics) == set(want_metrics)
        for key, want in want_metrics.items():
            assert_float(metrics[key], want)
    loss, _ = ppo_core.value_loss(values, old_values, returns, mask)
    assert_float(loss, ref.ref_value_loss(values, old_values, returns, mask)[0])


def test_value_loss_hand_computed():
    values = torch.tensor([[2.0, 0.2]], dtype=torch.float64)
    old_values = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # ε = 0.5: vc = [0.5, 0.2]; max((V-R)², (vc-R)²) = [max(1, 0.25), max(0.64, 0.64)]
    want = 0.5 * (1.0 + 0.64) / (2 + 1e-8)
    for fn in (ref.ref_value_loss, ppo_core.value_loss):
        loss, metrics = fn(values, old_values, returns, mask)
        assert_float(loss, want)
        assert_float(metrics["vf_clipfrac"], 0.0)
        assert_float(metrics["vpred_mean"], 2.2 / (2 + 1e-8))


# --------------------------------------------------------------------------------------
# property tests
# --------------------------------------------------------------------------------------

_PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROPS
@given(
    name=st.sampled_from(["k3", "low_var_kl"]),
    width=st.sampled_from([64, 32]),
    data=st.data(),
)
def test_k3_is_nonnegative(name, width, data):
    # any finite inputs (finite in the tensor's dtype), including ones whose difference
    # overflows to ±inf, and tiny differences where e^κ − κ − 1 would round below 0
    dtype = torch.float64 if width == 64 else torch.float32
    finite = st.floats(allow_nan=False, allow_infinity=False, width=width)
    pairs = data.draw(st.lists(st.tuples(finite, finite), min_size=1, max_size=16))
    logprob = torch.tensor([[p for p, _ in pairs]], dtype=torch.float64).to(dtype)
    ref_logprob = torch.tensor([[q for _, q in pairs]], dtype=torch.float64).to(dtype)
    out = ppo_core.kl_penalty(logprob, ref_logprob, name)
    assert not out.isnan().any()
    assert (out >= 0).all(), out
    assert (out <= 10).all(), out


def test_k3_is_nonnegative_for_tiny_differences():
    # the rounding regime found by the property test: |Δ| between 1e-12 and 1e-1
    kappa = torch.logspace(-12, -1, 2000, dtype=torch.float64)
    kappa = torch.cat([kappa, -kappa])
    for dtype in (torch.float64, torch.float32):
        k = kappa.to(dtype)
        assert (ppo_core.kl_penalty(torch.zeros_like(k), k, "k3") >= 0).all()


_logprob = st.floats(-1e4, 1e4, allow_nan=False)


@_PROPS
@given(
    pairs=st.lists(st.tuples(_logprob, _logprob), min_size=1, max_size=16),
    name=st.sampled_from([n for n in KL_ESTIMATORS if not n.endswith("+")]),
)
def test_straight_through_has_the_named_value(pairs, name):
    logprob = torch.tensor([[p for p, _ in pairs]], dtype=torch.float64)
    ref_logprob = torch.tensor([[q for _, q in pairs]], dtype=torch.float64)
    plus = ppo_core.kl_penalty(logprob, ref_logprob, name + "+")
    assert_tensor(plus, ref.ref_kl_penalty(logprob, ref_logprob, name))


@st.composite
def _reward_batches(draw, all_valid: bool):
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 10))
    reward = st.floats(-1e3, 1e3, allow_nan=False)
    rewards = [draw(st.lists(reward, min_size=length, max_size=length)) for _ in range(batch)]
    if all_valid:
        mask = [[1] * length for _ in range(batch)]
    else:
        bit = st.integers(0, 1)
        mask = [draw(st.lists(bit, min_size=length, max_size=length)) for _ in range(batch)]
    return rewards, mask


def _check_reward_to_go(rewards, mask):
    assume(sum(map(sum, mask)) >= 2)  # whitening needs two valid tokens
    r = torch.tensor(rewards, dtype=torch.float64)
    m = torch.tensor(mask)
    adv, ret = ppo_core.compute_gae(r, torch.zeros_like(r), m, 1.0, 1.0)
    for b, (r_row, m_row) in enumerate(zip(rewards, mask, strict=True)):
        for t in range(len(r_row)):
            # sum of the rewards of the valid tokens at or after t; at a masked t that is
            # the sum over the valid tokens strictly after t (its own reward is skipped)
            terms = [r_row[s] for s in range(t, len(r_row)) if m_row[s]]
            want = math.fsum(terms)
            scale = 1.0 + math.fsum(abs(x) for x in r_row)
            assert abs(float(ret[b, t]) - want) <= 1e-12 * scale, (b, t, float(ret[b, t]), want)
    # the advantages are those returns, whitened over the valid tokens of the batch; the
    # whitening amplifies rounding by 1/σ, so the tolerance follows the conditioning
    sigma = math.sqrt(float(ref.ref_masked_var(ret, m)) + 1e-8)
    atol = 1e-12 * (1.0 + float(ret.abs().max())) / sigma
    assert_tensor(adv, ref.ref_masked_whiten(ret, m), rtol=1e-9, atol=atol)


@_PROPS
@given(_reward_batches(all_valid=True))
def test_gae_undiscounted_zero_values_is_reward_to_go(case):
    """γ = λ = 1, V = 0, all tokens valid: returns_t = Σ_{s≥t} r_s."""
    _check_reward_to_go(*case)


@_PROPS
@given(_reward_batches(all_valid=False))
def test_gae_undiscounted_zero_values_skips_masked_tokens(case):
    """With interior masks: returns_t = Σ_{s≥t, m_s=1} r_s — masked rewards are ignored and
    a masked position carries the return of the next valid token (0 after the last)."""
    _check_reward_to_go(*case)


@_PROPS
@given(
    init=st.floats(1e-6, 1e3),
    target=st.floats(1e-6, 1e3),
    horizon=st.floats(1e-3, 1e7),
    data=st.data(),
)
def test_adaptive_kl_controller_stays_positive(init, target, horizon, data):
    # horizon ≤ 1e7 keeps n_steps / horizon below 5 after rounding, and at most 20
    # updates keep β far above the float64 underflow (each factor is ≥ 0.2 / horizon).
    ctl = AdaptiveKLController(init, target, horizon)
    max_steps = math.ceil(5 * horizon) - 1  # the largest integer n with n < 5·horizon
    kl = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
    updates = data.draw(
        st.lists(st.tuples(kl, st.integers(0, max_steps), st.booleans()), max_size=20)
    )
    for current_kl, n_steps, as_tensor in updates:
        before = ctl.value
        ctl.update(
            torch.tensor(current_kl, dtype=torch.float64) if as_tensor else current_kl, n_steps
        )
        assert ctl.value > 0
        assert math.isfinite(ctl.value)
        # one update moves β by at most 20 % per horizon of samples, in the KL's direction
        err = min(max(current_kl / target - 1.0, -0.2), 0.2)
        assert math.isclose(ctl.value, before * (1 + err * n_steps / horizon), rel_tol=1e-12)
    with pytest.raises(ValueError):
        ctl.update(0.0, -1)
    with pytest.raises(ValueError):
        ctl.update(0.0, math.ceil(5 * horizon))


@_PROPS
@given(
    coef=st.floats(0.0, 1e6),
    updates=st.lists(
        st.tuples(st.floats(min_value=0.0, allow_nan=False), st.integers(0, 10**9)), max_size=20
    ),
)
def test_fixed_kl_controller_is_constant(coef, updates):
    ctl = FixedKLController(coef)
    for current_kl, n_steps in updates:
        ctl.update(current_kl, n_steps)
        assert ctl.value == coef
