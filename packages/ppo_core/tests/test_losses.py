"""Loss aggregation, clipped policy loss and clipped value loss."""

import math

import pytest
import torch

from ppo_core import LOSS_AGG_MODES, aggregate_loss, policy_loss, value_loss

D = torch.float64
# Row 2 is all-masked: it must neither contribute nor count in the sequence modes.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 7 / 3),  # (1 + 2 + 4) / 3
        ("seq-mean-token-sum", {}, 3.5),  # (3 + 4) / 2 rows
        ("seq-mean-token-mean", {}, 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", {}, (1 + 4 / 3) / 2),  # L = T = 3: (3/3 + 4/3) / 2
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 2}, 1.75),  # (1.5 + 2) / 2
        ("token-mean", {"global_num_tokens": 14, "dp_size": 2}, 1.0),  # 7 / 14 · 2
        ("seq-mean-token-sum", {"global_num_seqs": 7, "dp_size": 3}, 3.0),  # 7 / 7 · 3
        ("seq-mean-token-mean", {"global_num_seqs": 11}, 5.5 / 11),
    ],
)
def test_aggregate_hand_values(mode, kwargs, expected) -> None:
    assert aggregate_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_all_masked_batch_gives_zero() -> None:
    none = torch.zeros_like(MASK)
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, none, mode).item() == 0.0
        assert aggregate_loss(LOSS, none, mode, global_num_tokens=0, global_num_seqs=0).item() == 0


def test_aggregate_validates() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'.*token-mean"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="`mask` has shape"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="dp_size"):
        aggregate_loss(LOSS, MASK, "token-mean", dp_size=0)


def global_mean(loss, mask, mode, scale=7):
    """The full-batch value that gradient accumulation over all ranks must reproduce."""
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    rows = m.sum(-1) > 0
    token_sum = (loss * m).sum(-1)[rows]
    per_seq = {
        "seq-mean-token-sum": token_sum,
        "seq-mean-token-mean": token_sum / m.sum(-1)[rows],
        "seq-mean-token-sum-norm": token_sum / scale,
    }[mode]
    return per_seq.mean()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(5))
def test_micro_batch_shares_sum_to_the_global_mean(mode: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(13, 7, dtype=D, generator=gen)
    mask = (torch.rand(13, 7, generator=gen) < 0.6).long()
    mask[4] = 0  # an all-masked row
    # 2 simulated DP ranks; uneven micro-batches within each rank
    ranks = [[slice(0, 1), slice(1, 5)], [slice(5, 12), slice(12, 13)]]
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum()
    per_rank = [
        sum(
            aggregate_loss(
                loss[mb],
                mask[mb],
                mode,
                global_num_tokens=num_tokens,
                global_num_seqs=num_seqs,
                dp_size=2,
                loss_scale_factor=7,
            )
            for mb in micro_batches
        )
        for micro_batches in ranks
    ]
    dp_averaged = sum(per_rank) / 2  # what DDP/FSDP gradient averaging does
    torch.testing.assert_close(dp_averaged, global_mean(loss, mask, mode), rtol=1e-12, atol=1e-12)


def test_local_micro_batch_means_are_not_the_global_mean() -> None:
    # Why the counts exist: averaging per-micro-batch token means over-weights short ones.
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    naive = (
        aggregate_loss(loss[:1], mask[:1], "token-mean")
        + aggregate_loss(loss[1:], mask[1:], "token-mean")
    ) / 2  # (1 + 4) / 2
    assert naive.item() == pytest.approx(2.5)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 4)


# Four tokens: (A, ρ) = (1, 1.5), (1, 1.1), (−1, 0.5), (−1, 4)
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
OLD = torch.zeros(1, 4, dtype=D)
LOGPROB = torch.log(torch.tensor([[1.5, 1.1, 0.5, 4.0]], dtype=D))
ONES = torch.ones(1, 4)


def test_policy_loss_hand_values() -> None:
    # ℓ: max(−1.5, −1.2) = −1.2 (clipped) | max(−1.1, −1.1) = −1.1
    #    max(0.5, 0.8) = 0.8 (clipped)    | max(4, 1.2) = 4 → dual clip min(4, 3) = 3
    loss, metrics = policy_loss(LOGPROB, OLD, ADV, ONES)
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 3.0) / 4)  # 0.375
    assert metrics["pg_loss"].item() == pytest.approx(0.375)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)  # tokens 1 and 3
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # token 4
    # ppo_kl = mean(old − new) = −(ln 1.5 + ln 1.1 + ln 0.5 + ln 4) / 4 = −0.29848
    expected_kl = -(math.log(1.5) + math.log(1.1) + math.log(0.5) + math.log(4)) / 4
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl)
    assert all(not m.requires_grad for m in metrics.values())


def test_policy_loss_gradient_is_zero_where_clipped() -> None:
    logprob = LOGPROB.clone().requires_grad_(True)
    loss, _ = policy_loss(logprob, OLD, ADV, ONES)
    (grad,) = torch.autograd.grad(loss, logprob)
    # only token 2 is unclipped: d/dlogprob (−A·e^{logprob − old}) / 4 = −1.1 / 4
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.275, 0.0, 0.0]], dtype=D))


def test_policy_loss_without_dual_clip_and_asymmetric_clip() -> None:
    # no dual clip: token 4 keeps 4; clip-higher 0.28 leaves token 1 at max(−1.5, −1.28)
    loss, metrics = policy_loss(LOGPROB, OLD, ADV, ONES, clip_ratio_c=None, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 4.0) / 4)
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_policy_loss_validates() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(LOGPROB, OLD, ADV, ONES, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="`advantages` has shape"):
        policy_loss(LOGPROB, OLD, ADV[:, :3], ONES)
    with pytest.raises(ValueError, match="`old_logprob` must be a floating-point tensor"):
        policy_loss(LOGPROB, OLD.long(), ADV, ONES)


def test_value_loss_hand_values() -> None:
    values = torch.tensor([[1.0, 2.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.0, 1.0]], dtype=D)
    returns = torch.tensor([[0.0, 3.0]], dtype=D)
    # t0: clip(1, −0.5, 0.5) = 0.5: max((1 − 0)², (0.5 − 0)²) = 1 (unclipped)
    # t1: clip(2, 0.5, 1.5) = 1.5: max((2 − 3)², (1.5 − 3)²) = 2.25 (clipped)
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.5)
    assert loss.item() == pytest.approx(0.5 * (1 + 2.25) / 2)  # 0.8125
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["vpred_mean"].item() == pytest.approx(1.5)
    (grad,) = torch.autograd.grad(loss, values)
    # t0: d/dV ½·(V − R)²/2 = (1 − 0)/2 = 0.5; t1 is clipped: 0
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.0]], dtype=D))
