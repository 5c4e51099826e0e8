"""actor_update_step: micro-batched shares give exactly the full mini-batch gradient."""

import math

import pytest
import torch
from train_testing import prompt_response_batch

from klppo_train.actor import PolicyBatch, actor_update_step
from klppo_train.config import ActorConfig
from klppo_train.demo.embedded import build_model
from klppo_train.forward import response_logprobs
from ppo_core import aggregate_loss, kl_penalty, policy_loss

P, T, VOCAB = 5, 4, 64


def make_batch() -> PolicyBatch:
    gen = torch.Generator().manual_seed(0)
    ids, mask = prompt_response_batch(
        [5, 2, 4, 3, 5, 1], [4, 1, 3, 2, 4, 2], P, T, VOCAB, generator=gen
    )
    with torch.no_grad():
        current, _ = response_logprobs(
            build_model(VOCAB, seed=0, hidden=64), ids, mask, T, max_tokens=1000
        )
    noise = lambda: 0.3 * torch.randn(6, T, generator=gen)  # noqa: E731
    return PolicyBatch(
        ids,
        mask,
        mask[:, P:],
        (current + noise()).detach(),
        torch.randn(6, T, generator=gen),
        (current + noise()).detach(),
    )


def reference_step(model, batch: PolicyBatch, cfg: ActorConfig) -> None:
    """The loss of the whole batch at once (local token mean), the same three terms."""
    logprobs, entropy = response_logprobs(
        model, batch.input_ids, batch.attention_mask, T, max_tokens=1000, with_entropy=True
    )
    loss, _ = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask)
    loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, batch.response_mask, "token-mean")
    kl = kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_loss_type)
    loss = loss + cfg.kl_loss_coef * aggregate_loss(kl, batch.response_mask, "token-mean")
    loss.backward()


@pytest.mark.parametrize("budget", [9, 20, 1000])  # 6, 3 and 1 micro-batches
def test_micro_batches_reproduce_the_full_batch_step(budget: int) -> None:
    cfg = ActorConfig(
        ppo_max_token_len_per_gpu=budget,
        grad_clip=1e9,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
    )
    batch = make_batch()
    ours, ref = build_model(VOCAB, seed=0, hidden=64), build_model(VOCAB, seed=0, hidden=64)
    metrics = actor_update_step(
        ours, torch.optim.SGD(ours.parameters(), lr=0.5), batch, cfg, max_tokens=budget
    )
    reference_step(ref, batch, cfg)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/grad_norm",
    }
    assert set(metrics) == expected and all(math.isfinite(v) for v in metrics.values())


def test_non_finite_gradient_skips_the_step() -> None:
    batch = make_batch()
    bad = PolicyBatch(
        batch.input_ids,
        batch.attention_mask,
        batch.response_mask,
        batch.old_logprobs,
        batch.advantages * float("nan"),
    )
    model = build_model(VOCAB, seed=0, hidden=64)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = actor_update_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        bad,
        ActorConfig(),
        max_tokens=1000,
    )
    assert not math.isfinite(metrics["actor/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
