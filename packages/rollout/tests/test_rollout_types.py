"""Sampling config, batch tensors, prompt checks, mismatch probe, HF engine, WeightSync."""

import math

import pytest
import torch
from rollout_testing import EOS, PAD, VOCAB, recompute_logprobs, tiny_model

from rollout import (
    HFEngine,
    HFEngineConfig,
    RolloutBatch,
    RolloutEngine,
    Sample,
    SamplingConfig,
    WeightSync,
    logprob_mismatch,
)
from rollout.types import check_prompts

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
    ],
)
def test_sampling_config_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**kwargs)


def test_response_tensors() -> None:
    batch = RolloutBatch(
        [
            Sample(0, (4, 1), (-0.5, -1.0), "stop", 3),
            Sample(0, (7, 8, 9), (-1.0, -2.0, -3.0), "length", 3),
        ],
        3,
    )
    ids, logprobs, mask = batch.response_tensors(pad_token_id=PAD)
    assert ids.tolist() == [[4, 1, PAD], [7, 8, 9]]
    assert logprobs.tolist() == [[-0.5, -1.0, 0.0], [-1.0, -2.0, -3.0]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="sample 1 has 3 tokens, more than width=2"):
        batch.response_tensors(PAD, width=2)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([], "empty prompt list"),
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 2], [3] * 10], "prompt 1 has 10 tokens; max_model_len=10"),
        (
            [[1, 200, 2, -1]],
            r"prompt 0 has token ids outside the vocabulary \[0, 128\): \[200, -1\]",
        ),
    ],
)
def test_bad_prompts_are_refused(prompts, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_prompts(prompts, VOCAB, max_len=10)


def test_logprob_mismatch_hand_values() -> None:
    engine = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = logprob_mismatch(engine, trainer, mask)
    assert m["rollout/logprob_diff_mean"].item() == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert m["rollout/logprob_diff_max"].item() == pytest.approx(0.5)
    # k3 with r = trainer − engine = −0.5: e^r − r − 1 = 0.10653; 0 for the equal token
    assert m["rollout/logprob_k3_kl"].item() == pytest.approx((math.exp(-0.5) + 0.5 - 1) / 2)
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(engine, trainer[:, :2], mask)


def hf_engine(model) -> HFEngine:
    return HFEngine(
        model, HFEngineConfig(pad_token_id=PAD, eos_token_ids=(EOS,), max_tokens_per_batch=40)
    )


def test_hf_engine_groups_samples_and_logprobs_match_the_model(model) -> None:
    engine = hf_engine(model)
    assert isinstance(engine, RolloutEngine)
    batch = engine.generate(PROMPTS, SamplingConfig(n=3, temperature=0.8, max_new_tokens=6, seed=0))
    assert [s.prompt_index for s in batch.samples] == [0, 0, 0, 1, 1, 1]
    for s in batch.samples:
        assert len(s.logprobs) == len(s.response_token_ids) >= 1
        assert (s.finish_reason == "stop") == (s.response_token_ids[-1] == EOS)
        expected = recompute_logprobs(model, PROMPTS[s.prompt_index], s.response_token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
    assert engine.stats()["generated_tokens"] == sum(
        len(s.response_token_ids) for s in batch.samples
    )


def test_hf_engine_update_weights_and_weight_sync(model) -> None:
    engine = hf_engine(model)
    trainer = tiny_model(seed=1)  # other weights
    sync = WeightSync(lambda: trainer.named_parameters(), engine)
    before = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=5))
    metrics = sync.sync(version=1)
    after = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=5))
    assert {s.policy_version for s in before.samples} == {0}
    assert {s.policy_version for s in after.samples} == {1}
    assert metrics["rollout/weight_sync_bytes"] == sum(p.numel() * 4 for p in trainer.parameters())
    for s in after.samples:
        expected = recompute_logprobs(trainer, PROMPTS[s.prompt_index], s.response_token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="must exceed the last version 1"):
        sync.sync(version=1)
    with pytest.raises(KeyError, match="no parameter 'lm_head.bias'"):
        engine.update_weights([("lm_head.bias", torch.zeros(3))], version=2)


def test_weight_sync_casts_to_the_engine_dtype_while_streaming(model) -> None:
    engine = hf_engine(tiny_model(seed=0).to(torch.bfloat16))
    trainer = tiny_model(seed=1)  # fp32 master weights
    seen = []

    def streamed():
        for name, tensor in trainer.named_parameters():
            seen.append(tensor.dtype)
            yield name, tensor.detach()

    metrics = WeightSync(streamed, engine, dtype=torch.bfloat16).sync(version=1)
    assert set(seen) == {torch.float32}
    assert metrics["rollout/weight_sync_bytes"] == sum(p.numel() * 2 for p in trainer.parameters())
    for (name, got), want in zip(
        engine.model.named_parameters(), trainer.parameters(), strict=True
    ):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.detach().to(torch.bfloat16), atol=0, rtol=0, msg=name)


def test_hf_ignore_eos_generates_to_the_limit(model) -> None:
    prompt = [PROMPTS[0]]
    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    first = hf_engine(model).generate(prompt, greedy).samples[0].response_token_ids[0]
    # Make the first greedy token the EOS, for the engine and in the model's own generation
    # config (transformers falls back to the latter when eos_token_id is None).
    model.generation_config.eos_token_id = first
    engine = HFEngine(model, HFEngineConfig(pad_token_id=PAD, eos_token_ids=(first,)))
    stopped = engine.generate(prompt, greedy).samples[0]
    assert stopped.response_token_ids == (first,) and stopped.finish_reason == "stop"
    ignoring = SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True)
    forced = engine.generate(prompt, ignoring).samples[0]
    assert len(forced.response_token_ids) == 6 and forced.finish_reason == "length"
    assert forced.response_token_ids[0] == first
