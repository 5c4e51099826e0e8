"""Trainee.optimizer_step (actor and critic alike): micro-batched shares give exactly the
full mini-batch step."""

import math
from dataclasses import replace

import pytest
import torch
from train_testing import prompt_response_batch
from transformers import Qwen2ForTokenClassification

from klppo_train.demo.embedded import build_model
from klppo_train.ppo.losses import PolicyLoss, ValueLoss
from klppo_train.workers.forward import response_logprobs, response_values
from klppo_train.workers.passes import Pass
from klppo_train.workers.trainee import Trainee
from klppo_train.workers.trajectories import Trajectories
from ppo_core import aggregate_loss, kl_penalty, policy_loss, value_loss

P, T, VOCAB = 5, 4, 64
POLICY = PolicyLoss(
    loss_mode="vanilla",
    hyperparameters=(("clip_ratio_low", 0.2), ("clip_ratio_high", 0.2), ("clip_ratio_c", 3.0)),
    policy_agg_mode="token-mean",
    loss_agg_mode="token-mean",
    entropy_coeff=0.01,
    use_kl_loss=True,
    kl_loss_coef=0.1,
    kl_loss_type="low_var_kl",
)


def critic(seed: int = 1) -> Qwen2ForTokenClassification:
    config = build_model(VOCAB, seed=0, hidden=64).config
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the token-classification head has 0.1 dropout by default
    torch.manual_seed(seed)
    return Qwen2ForTokenClassification(config)


def trainee(name: str, model, loss, optimizer=None, offload: bool = False) -> Trainee:
    return Trainee(
        name=name,
        model=model,
        optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.5),
        loss=loss,
        offload_optimizer=offload,
        update=Pass(name=f"update_{name}"),
        epochs=1,
        rows_per_mini_batch=6,
        grad_clip=1e9,
    )


def make_batch() -> Trajectories:
    gen = torch.Generator().manual_seed(0)
    ids, mask = prompt_response_batch(
        [5, 2, 4, 3, 5, 1], [4, 1, 3, 2, 4, 2], P, T, VOCAB, generator=gen
    )
    with torch.no_grad():
        current, _ = response_logprobs(
            build_model(VOCAB, seed=0, hidden=64), ids, mask, T, max_tokens=1000
        )
        values = response_values(critic(), ids, mask, T, max_tokens=1000)
    noise = lambda: 0.3 * torch.randn(6, T, generator=gen)  # noqa: E731
    return Trajectories(
        input_ids=ids,
        attention_mask=mask,
        response_mask=mask[:, P:],
        engine_logprobs=torch.zeros(6, T),
        prompt_index=torch.arange(6),
        old_logprobs=(current + noise()).detach(),
        advantages=torch.randn(6, T, generator=gen),
        ref_logprobs=(current + noise()).detach(),
        values=values + 0.1 * torch.randn(6, T, generator=gen),
        returns=torch.randn(6, T, generator=gen),
    )


def reference_policy_step(model, batch: Trajectories) -> None:
    """The loss of the whole batch at once (local token mean), the same three terms."""
    logprobs, entropy = response_logprobs(
        model, batch.input_ids, batch.attention_mask, T, max_tokens=1000, with_entropy=True
    )
    loss, _ = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask)
    loss = loss - POLICY.entropy_coeff * aggregate_loss(entropy, batch.response_mask, "token-mean")
    kl = kl_penalty(logprobs, batch.ref_logprobs, POLICY.kl_loss_type)
    loss = loss + POLICY.kl_loss_coef * aggregate_loss(kl, batch.response_mask, "token-mean")
    loss.backward()


def assert_same_parameters(ours, ref) -> None:
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)


@pytest.mark.parametrize("budget", [9, 20, 1000])  # 6, 3 and 1 micro-batches
def test_actor_micro_batches_reproduce_the_full_batch_step(budget: int) -> None:
    batch = make_batch()
    ours, ref = build_model(VOCAB, seed=0, hidden=64), build_model(VOCAB, seed=0, hidden=64)
    metrics = trainee("actor", ours, POLICY).optimizer_step(batch, budget)
    reference_policy_step(ref, batch)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert_same_parameters(ours, ref)
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


@pytest.mark.parametrize("budget", [9, 1000])  # one micro-batch per row, and one in all
def test_critic_micro_batches_reproduce_the_full_batch_step(budget: int) -> None:
    batch = make_batch()
    ours, ref = critic(), critic()
    loss_fn = ValueLoss(cliprange_value=0.2, loss_agg_mode="token-mean")
    metrics = trainee("critic", ours, loss_fn).optimizer_step(batch, budget)
    values = response_values(ref, batch.input_ids, batch.attention_mask, T, max_tokens=1000)
    loss, _ = value_loss(values, batch.values, batch.returns, batch.response_mask, clip_range=0.2)
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert_same_parameters(ours, ref)
    assert metrics["critic/vf_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert set(metrics) == {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
    }
    assert all(math.isfinite(v) for v in metrics.values())


def test_non_finite_gradient_skips_the_step() -> None:
    batch = make_batch()
    bad = replace(batch, advantages=batch.advantages * float("nan"))
    model = build_model(VOCAB, seed=0, hidden=64)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainee("actor", model, POLICY).optimizer_step(bad, 1000)
    assert not math.isfinite(metrics["actor/grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_optimizer_offload_keeps_the_state_in_host_memory_between_steps() -> None:
    batch = make_batch()
    batch = Trajectories(
        **{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(batch).items()}
    )
    model = critic().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = ValueLoss(cliprange_value=0.5, loss_agg_mode="token-mean")
    offloaded = trainee("critic", model, loss_fn, optimizer, offload=True)
    for _ in range(2):  # the second step loads the offloaded state back first
        offloaded.optimizer_step(batch, 1000)
        states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        assert states and all(t.device.type == "cpu" for t in states)
    assert next(model.parameters()).device.type == "cuda"
