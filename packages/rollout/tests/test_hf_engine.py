"""HFEngine sampling: per-request seeded streams, log-probs of the warped distribution."""

import math

import pytest
import torch
from rollout_testing import EOS, PAD, tiny_model

from rollout import HFEngine, HFEngineConfig, SamplingConfig

P, Q, R = [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
SAMPLING = SamplingConfig(n=3, temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=8)


def engine_for(model, max_tokens_per_batch: int = 16384) -> HFEngine:
    config = HFEngineConfig(
        pad_token_id=PAD, eos_token_ids=(EOS,), max_tokens_per_batch=max_tokens_per_batch
    )
    return HFEngine(model, config)


def peaked_model() -> torch.nn.Module:
    """:func:`tiny_model` with its head scaled so the next-token distribution is far from
    uniform (a random tiny model's is nearly flat: temperature would barely matter)."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    return model


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the fewest most likely tokens whose mass
    reaches ``top_p``), written out here; filtered tokens get -inf."""
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        drop = (probs.cumsum(-1) - probs) >= top_p  # mass of the more likely tokens
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return logits


def samples_of(batch, prompt_index: int) -> list[tuple]:
    return [
        (s.response_token_ids, s.logprobs, s.finish_reason)
        for s in batch.samples
        if s.prompt_index == prompt_index
    ]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert [(tokens, reason) for tokens, _, reason in got] == [
        (tokens, reason) for tokens, _, reason in want
    ]
    for (_, lp_got, _), (_, lp_want, _) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=1e-5, rtol=0)


def test_a_prompts_samples_do_not_depend_on_the_rest_of_the_call(model) -> None:
    engine = engine_for(model)
    alone = samples_of(engine.generate([P], SAMPLING, seeds=[7]), 0)
    assert len({tokens for tokens, _, _ in alone}) == 3  # the n samples differ
    assert_same(samples_of(engine.generate([Q, P, R], SAMPLING, seeds=[1, 7, 2]), 1), alone)
    assert_same(samples_of(engine.generate([R, Q, P], SAMPLING, seeds=[2, 1, 7]), 2), alone)
    # rows × (10-token prompt + 8) > 40: at most 2 rows per model.generate, split mid-prompt
    chunked = engine_for(model, max_tokens_per_batch=40)
    assert_same(samples_of(chunked.generate([Q, P, R], SAMPLING, seeds=[1, 7, 2]), 1), alone)
    # per-prompt response caps generate to the largest and cut: the kept tokens are the same
    capped = engine.generate([Q, P], SAMPLING, seeds=[1, 7], max_new_tokens=[3, 8])
    assert_same(samples_of(capped, 1), alone)


def test_two_ranks_equal_one(model) -> None:
    """Each rank generating its slice of the prompts (with their seeds) equals one rank
    generating them all, as with vLLM's per-request seeds."""
    prompts, seeds = [P, Q, R, Q, P, R], [10, 11, 12, 13, 14, 15]
    one = engine_for(model).generate(prompts, SAMPLING, seeds=seeds)
    ranks = [
        engine_for(model, 60).generate(prompts[s], SAMPLING, seeds=seeds[s])
        for s in (slice(0, 3), slice(3, 6))
    ]
    for i in range(6):
        assert_same(samples_of(ranks[i // 3], i % 3), samples_of(one, i))


def test_seeds_pick_the_samples(model) -> None:
    engine = engine_for(model)
    sampling = SamplingConfig(n=1, temperature=0.9, max_new_tokens=8)
    firsts = engine.generate([P] * 8, sampling, seeds=list(range(8)))
    assert len({s.response_token_ids for s in firsts.samples}) == 8
    again = engine.generate([P] * 8, sampling, seeds=list(range(8)))
    assert [s.response_token_ids for s in again.samples] == [
        s.response_token_ids for s in firsts.samples
    ]
    # without per-prompt seeds: sampling.seed seeds each row from (seed, prompt, sample)
    seeded = SamplingConfig(n=2, temperature=0.9, max_new_tokens=8, seed=3)
    one, two = (engine.generate([P, P], seeded) for _ in range(2))
    assert [s.response_token_ids for s in one.samples] == [
        s.response_token_ids for s in two.samples
    ]
    assert len({s.response_token_ids for s in one.samples}) == 4  # duplicates differ
    # with neither: a base seed from torch's global generator
    unseeded = SamplingConfig(n=2, temperature=0.9, max_new_tokens=8)
    torch.manual_seed(0)
    one = engine.generate([P], unseeded)
    torch.manual_seed(0)
    assert engine.generate([P], unseeded).samples == one.samples
    assert engine.generate([P], unseeded).samples != one.samples


def test_logprobs_are_of_the_warped_distribution() -> None:
    model = peaked_model()
    sampling = SamplingConfig(n=4, temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=6)
    prompts = [P, Q, R]
    batch = engine_for(model).generate(prompts, sampling, seeds=[0, 1, 2])
    for s in batch.samples:
        prompt, response = prompts[s.prompt_index], s.response_token_ids
        ids = torch.tensor([prompt + list(response)])
        with torch.no_grad():  # a plain forward pass, no padding, no cache
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        warped = torch.log_softmax(warp(logits, 0.7, 20, 0.8), dim=-1)
        expected = warped.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.isfinite(expected).all()  # sampled inside top-k / top-p
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_first_tokens_follow_the_warped_distribution() -> None:
    model = peaked_model()
    temperature, top_k, top_p, draws = 0.7, 8, 0.97, 4000
    sampling = SamplingConfig(
        n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1
    )
    batch = engine_for(model).generate([P] * (draws // 2), sampling, seeds=range(draws // 2))
    counts = torch.bincount(
        torch.tensor([s.response_token_ids[0] for s in batch.samples]), minlength=128
    )
    with torch.no_grad():
        logits = model(torch.tensor([P])).logits[0, -1].float()
    want = warp(logits, temperature, top_k, top_p).softmax(-1)
    got = counts / draws
    bound = 5 * math.sqrt(0.25 / draws)  # 5 σ of a frequency
    assert counts[want == 0].sum() == 0
    assert (got - want).abs().max() < bound
    # the test can fail: ignoring the temperature would be well outside the bound
    untempered = warp(logits, 1.0, top_k, top_p).softmax(-1)
    assert (untempered - want).abs().max() > 3 * bound


def test_greedy_and_the_models_generation_config(model) -> None:
    """Greedy ignores seeds; the model's own generation settings (here: suppressing the
    greedy token, a repetition penalty) change nothing and are left in place."""
    engine = engine_for(model)
    greedy = SamplingConfig(n=2, temperature=0, max_new_tokens=6)
    base = engine.generate([P, Q], greedy)
    assert engine.generate([P, Q], greedy, seeds=[5, 6]).samples == base.samples
    first = base.samples[0].response_token_ids[0]
    model.generation_config.suppress_tokens = [first]
    model.generation_config.repetition_penalty = 5.0
    assert engine.generate([P, Q], greedy).samples == base.samples
    sampled = engine.generate([P], SAMPLING, seeds=[7])
    assert model.generation_config.suppress_tokens == [first]  # the model's, put back
    model.generation_config.suppress_tokens = None
    model.generation_config.repetition_penalty = None
    assert_same(samples_of(engine.generate([P], SAMPLING, seeds=[7]), 0), samples_of(sampled, 0))


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_match_the_trainers_recompute_at_temperature_one(model, greedy) -> None:
    sampling = SamplingConfig(n=2, temperature=0 if greedy else 1.0, max_new_tokens=6)
    batch = engine_for(model, 40).generate([P, R], sampling, seeds=[0, 1])
    for s in batch.samples:
        prompt = [P, R][s.prompt_index]
        ids = torch.tensor([prompt + list(s.response_token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)
