"""Log-probabilities and entropies from logits: hand values, chunking, bf16, gradients."""

import math

import pytest
import torch

import ppo_core.logits as logits_module
from ppo_core import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits

# softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]
Z = torch.tensor([[[0.0, math.log(2), math.log(3)]]], dtype=torch.float64)


def test_logprob_hand_values() -> None:
    assert logprobs_from_logits(Z, torch.tensor([[2]])).item() == pytest.approx(math.log(1 / 2))
    assert logprobs_from_logits(Z, torch.tensor([[0]])).item() == pytest.approx(math.log(1 / 6))


def test_temperature_divides_logits() -> None:
    # z / 2 = [0, ln √2, ln √3]: p ∝ [1, √2, √3], sum 4.14626
    expected = -math.log(1 + math.sqrt(2) + math.sqrt(3))  # -1.42221
    got = logprobs_from_logits(Z, torch.tensor([[0]]), temperature=2.0).item()
    assert got == pytest.approx(expected)


def test_entropy_hand_values() -> None:
    # H = (1/6) ln 6 + (1/3) ln 3 + (1/2) ln 2 = 1.01140
    expected = math.log(6) / 6 + math.log(3) / 3 + math.log(2) / 2
    assert entropy_from_logits(Z).item() == pytest.approx(expected)
    uniform = entropy_from_logits(torch.zeros(2, 3, 4))  # uniform over 4: ln 4
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(4)))


@pytest.fixture
def tiny_chunks(monkeypatch):
    # 2 rows of vocab 13 per chunk, so a [3, 5, 13] input runs through 8 chunks.
    monkeypatch.setattr(logits_module, "_CHUNK_ELEMENTS", 26)


def test_chunked_equals_log_softmax_and_has_its_gradient(tiny_chunks) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (3, 5))
    got = logprobs_from_logits(logits, labels, temperature=0.7)
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (grad_got,) = torch.autograd.grad(got.sum(), logits)
    (grad_want,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=1e-12)
    ent = entropy_from_logits(logits)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, -(p * torch.log_softmax(logits, -1)).sum(-1))


def test_bf16_logits_give_float32_results(tiny_chunks) -> None:
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 13) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 13, (2, 4))
    got = logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-5)
    assert entropy_from_logits(logits).dtype == torch.float32


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`labels` has shape \(1, 2\)"):
        logprobs_from_logits(Z, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="integer token ids"):
        logprobs_from_logits(Z, torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(Z, torch.tensor([[0]]), temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hand_written_backward_passes_gradcheck(tiny_chunks, temperature) -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (3, 5))

    def both(z):
        return logprobs_and_entropy(z, labels, temperature)

    assert torch.autograd.gradcheck(both, (logits,))
    # Each output alone (the other's gradient arrives as None).
    assert torch.autograd.gradcheck(lambda z: both(z)[0], (logits,))
    assert torch.autograd.gradcheck(lambda z: both(z)[1], (logits,))


def test_joint_values_equal_log_softmax_reference(tiny_chunks) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 7, 13, dtype=torch.float64) * 4
    labels = torch.randint(0, 13, (4, 7))
    logprob, entropy = logprobs_and_entropy(logits, labels, temperature=1.3)
    log_p = torch.log_softmax(logits / 1.3, -1)
    torch.testing.assert_close(logprob, log_p.gather(-1, labels[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
    assert logprobs_and_entropy(logits, labels, with_entropy=False)[1] is None


def test_bf16_gradient_matches_float64(tiny_chunks) -> None:
    torch.manual_seed(4)
    logits = (torch.randn(6, 13) * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 13, (6,))
    logprob, entropy = logprobs_and_entropy(logits, labels)
    (logprob.sum() + 0.5 * entropy.sum()).backward()
    exact = logits.detach().double().requires_grad_()
    lp, h = logprobs_and_entropy(exact, labels)
    (lp.sum() + 0.5 * h.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=0, atol=1e-2)


def test_autograd_keeps_no_float32_copy_of_the_logits() -> None:
    # The memory point of the chunked backward: what autograd saves is the logits themselves
    # (bf16 here) and per-row floats, never a [N, V] float32 softmax or log-softmax.
    logits = torch.randn(64, 1000).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 1000, (64,))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_and_entropy(logits, labels)
    assert saved and all(n <= 64 or dtype == torch.bfloat16 for dtype, n in saved), saved


def test_empty_input() -> None:
    logprob, entropy = logprobs_and_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert logprob.shape == entropy.shape == (0,)


def test_sum_pi_squared_hand_values(tiny_chunks) -> None:
    """p = [1/6, 2/6, 3/6]: Σp² = (1 + 4 + 9) / 36 = 7/18; uniform over 4: 1/4; at τ = 2,
    p ∝ [1, √2, √3]: Σp² = (1 + 2 + 3) / (1 + √2 + √3)²; against softmax² on random
    logits over 8 chunks; bf16 in, float32 out."""
    from ppo_core import sum_pi_squared_from_logits

    assert sum_pi_squared_from_logits(Z).item() == pytest.approx(7 / 18, abs=1e-12)
    torch.testing.assert_close(sum_pi_squared_from_logits(torch.zeros(2, 3, 4)),
                               torch.full((2, 3), 0.25))  # fmt: skip
    hot = 6 / (1 + math.sqrt(2) + math.sqrt(3)) ** 2
    assert sum_pi_squared_from_logits(Z, temperature=2.0).item() == pytest.approx(hot, abs=1e-12)
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 13, dtype=torch.float64) * 4
    want = torch.softmax(logits / 0.7, -1).square().sum(-1)
    got = sum_pi_squared_from_logits(logits, 0.7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    half = sum_pi_squared_from_logits(logits.to(torch.bfloat16), 0.7)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.double(), want, rtol=0, atol=0.05)
    with pytest.raises(ValueError, match="temperature"):
        sum_pi_squared_from_logits(Z, temperature=0.0)
