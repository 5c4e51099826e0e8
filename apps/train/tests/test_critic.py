"""critic_update_step: micro-batched shares give exactly the full mini-batch value-loss step."""

import math

import pytest
import torch
from train_testing import prompt_response_batch
from transformers import Qwen2ForTokenClassification

from fsdp_sharding import ShardingConfig
from klppo_train.config import CriticConfig
from klppo_train.critic import ValueBatch, critic_update_step
from klppo_train.demo.embedded import build_model
from klppo_train.forward import response_values
from ppo_core import value_loss

P, T, VOCAB = 5, 4, 64


def critic(seed: int = 1) -> Qwen2ForTokenClassification:
    config = build_model(VOCAB, seed=0, hidden=64).config
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the token-classification head has 0.1 dropout by default
    torch.manual_seed(seed)
    return Qwen2ForTokenClassification(config)


def make_batch() -> ValueBatch:
    gen = torch.Generator().manual_seed(0)
    ids, mask = prompt_response_batch(
        [5, 2, 4, 3, 5, 1], [4, 1, 3, 2, 4, 2], P, T, VOCAB, generator=gen
    )
    with torch.no_grad():
        values = response_values(critic(), ids, mask, T, max_tokens=1000)
    return ValueBatch(
        ids,
        mask,
        mask[:, P:],
        values + 0.1 * torch.randn(6, T, generator=gen),
        torch.randn(6, T, generator=gen),
    )


@pytest.mark.parametrize("budget", [9, 1000])  # one micro-batch per row, and one in all
def test_micro_batches_reproduce_the_full_batch_step(budget: int) -> None:
    cfg = CriticConfig(ppo_max_token_len_per_gpu=budget, grad_clip=1e9, cliprange_value=0.2)
    batch = make_batch()
    ours, ref = critic(), critic()
    metrics = critic_update_step(
        ours, torch.optim.SGD(ours.parameters(), lr=0.5), batch, cfg, max_tokens=budget
    )
    values = response_values(ref, batch.input_ids, batch.attention_mask, T, max_tokens=1000)
    loss, _ = value_loss(
        values, batch.old_values, batch.returns, batch.response_mask, clip_range=0.2
    )
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)
    assert metrics["critic/vf_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert set(metrics) == {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
    }
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_optimizer_offload_keeps_the_state_in_host_memory_between_steps() -> None:
    cfg = CriticConfig(ppo_max_token_len_per_gpu=1000, fsdp=ShardingConfig(optimizer_offload=True))
    batch = make_batch()
    batch = ValueBatch(*(t.cuda() for t in vars(batch).values()))
    model = critic().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step loads the offloaded state back first
        critic_update_step(model, optimizer, batch, cfg, max_tokens=1000)
        states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        assert states and all(t.device.type == "cpu" for t in states)
    assert next(model.parameters()).device.type == "cuda"
