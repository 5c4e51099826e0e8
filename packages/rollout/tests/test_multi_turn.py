"""Multi-turn rollouts over a real HF engine: a tiny model taught to call the calculator,
exact token ids turn by turn, the loss mask, limits and failures."""

import threading

import pytest
import torch
from rollout_testing import (
    PAIRS,
    UserTurns,
    assert_well_formed,
    chat_model,
    chat_prompt,
    chat_tokenizer,
    recompute_logprobs,
    tool_model,
)

from rollout import (
    Calculator,
    HermesParser,
    HFEngine,
    HFEngineConfig,
    MultiTurnConfig,
    MultiTurnRollout,
    SamplingConfig,
    ToolBox,
    ToolEnvironment,
    TurnRenderer,
    multi_turn_metrics,
)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return TurnRenderer(tokenizer)


@pytest.fixture(scope="module")
def model(tokenizer, renderer):
    return tool_model(tokenizer, renderer)


def engine_for(model):
    return HFEngine(model, HFEngineConfig(pad_token_id=0, eos_token_ids=(1,)))


def decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def rollout(model, tokenizer, renderer, tools=None, config=None, environments=None):
    environments = environments or {
        "tool_agent": ToolEnvironment(
            ToolBox(tools or [Calculator()], timeout_s=0.3), HermesParser()
        )
    }
    return MultiTurnRollout(engine_for(model), renderer, decode(tokenizer), environments, config)


def prompts(tokenizer):
    return [chat_prompt(tokenizer, f"What is {a}*{b}?") for a, b in PAIRS]


def test_greedy_conversations_call_the_calculator_and_answer(model, tokenizer, renderer):
    batch = rollout(model, tokenizer, renderer).generate(
        prompts(tokenizer), SamplingConfig(temperature=0, max_new_tokens=80)
    )
    for sample, (a, b) in zip(batch.samples, PAIRS, strict=False):
        assert_well_formed(sample, tokenizer, renderer)
        assert [t.role for t in sample.turns] == ["assistant", "tool", "assistant"]
        assert sample.finish_reason == "stop" and sample.turns[1].calls == 1
        first, answer = (sample.response_token_ids[t.start : t.end] for t in sample.turns[::2])
        assert first[-1] == 1 and answer[-1] == 1  # each turn keeps its stop token
        assert tokenizer.decode(answer) == f"The answer is {a * b}.<|im_end|>"
        assert f"\n{a * b}<|im_end|>" in tokenizer.decode(
            sample.response_token_ids[sample.turns[1].start : sample.turns[1].end]
        )
    metrics = multi_turn_metrics(batch.samples)
    assert metrics["tool/calls_per_sample"] == 1 and metrics["tool/error_rate"] == 0
    assert metrics["multi_turn/turns"] == 3 and metrics["multi_turn/finish/stop"] == 1


def test_engine_logprobs_equal_the_trainers_over_every_turn(model, tokenizer, renderer):
    """Sampled (T = 1, 4 conversations a prompt): the trainer's teacher-forced log-probs of
    the whole trajectory equal the engine's on every generated token (fp32, 1e-4)."""
    qs = prompts(tokenizer)
    batch = rollout(model, tokenizer, renderer).generate(
        qs, SamplingConfig(n=4, temperature=1.0, max_new_tokens=80, seed=5)
    )
    assert [s.prompt_index for s in batch.samples] == [i for i in range(4) for _ in range(4)]
    assert max(len(s.turns) for s in batch.samples) >= 3
    for sample in batch.samples:
        assert_well_formed(sample, tokenizer, renderer)
        trainer = recompute_logprobs(model, qs[sample.prompt_index], sample.response_token_ids)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs)[mask], trainer[mask], atol=1e-4, rtol=0
        )


def test_ids_are_kept_where_decode_then_encode_differs(tokenizer, renderer):
    """A random model's turns are non-canonical BPE: re-encoding the decoded conversation
    gives other ids (and other log-probs); the rollout keeps the engine's, whose log-probs
    the trainer reproduces. The user turns of an environment hook, max_assistant_turns."""
    model = chat_model(tokenizer, seed=1)
    qs = prompts(tokenizer)
    stops = tuple(range(100, 200))  # end a random model's turns after a few tokens
    mt = rollout(
        model,
        tokenizer,
        renderer,
        environments={"tool_agent": UserTurns()},
        config=MultiTurnConfig(max_assistant_turns=3),
    )
    batch = mt.generate(qs, SamplingConfig(n=2, max_new_tokens=120, seed=3, stop_token_ids=stops))
    differs = 0
    for sample in batch.samples:
        assert_well_formed(sample, tokenizer, renderer)
        assert [t.role for t in sample.turns] == ["assistant", "user"] * 2 + ["assistant"]
        assert sample.finish_reason == "max_turns"
        ids = list(qs[sample.prompt_index]) + list(sample.response_token_ids)
        again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        differs += again != ids
        trainer = recompute_logprobs(model, qs[sample.prompt_index], sample.response_token_ids)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(sample.logprobs)[mask], trainer[mask], atol=1e-4, rtol=0
        )
    assert differs >= len(batch.samples) // 2


class Raises:
    name = "calculator"
    schema = Calculator.default_schema()

    def call(self, arguments, context):
        raise RuntimeError("the calculator is broken")


class Hangs:
    name = "calculator"
    schema = Calculator.default_schema()

    def __init__(self):
        self.release = threading.Event()

    def call(self, arguments, context):
        self.release.wait(20)
        return "0"


@pytest.mark.parametrize("tool, kind", [(Raises(), "raised"), (Hangs(), "timeout")])
def test_a_failing_tool_is_an_observation_and_the_run_goes_on(
    model, tokenizer, renderer, tool, kind
):
    batch = rollout(model, tokenizer, renderer, tools=[tool]).generate(
        prompts(tokenizer), SamplingConfig(temperature=0, max_new_tokens=80)
    )
    if isinstance(tool, Hangs):
        tool.release.set()
    for sample in batch.samples:
        assert_well_formed(sample, tokenizer, renderer)
        assert sample.turns[1].errors == (kind,)
        assert len(sample.turns) >= 3  # the model got the error text and went on
        assert "Error:" in tokenizer.decode(
            sample.response_token_ids[sample.turns[1].start : sample.turns[1].end]
        )
    metrics = multi_turn_metrics(batch.samples)
    assert metrics["tool/error_rate"] == 1 and metrics[f"tool/errors/{kind}"] >= 1


def test_limits_end_conversations_with_their_reason(model, tokenizer, renderer):
    qs = prompts(tokenizer)
    greedy = SamplingConfig(temperature=0, max_new_tokens=80)
    one_turn = rollout(model, tokenizer, renderer, config=MultiTurnConfig(max_assistant_turns=1))
    for sample in one_turn.generate(qs, greedy).samples:
        assert sample.finish_reason == "max_turns" and len(sample.turns) == 1
        assert sample.turns[0].end == len(sample.response_token_ids)
    no_answer = rollout(model, tokenizer, renderer, config=MultiTurnConfig(max_user_turns=1))
    assert {len(s.turns) for s in no_answer.generate(qs, greedy).samples} == {3}
    # budget: the call fits, the tool's answer does not -> the answer is cut at the budget
    # (as verl cuts a response), the call counted, and the conversation ends "length"
    full = rollout(model, tokenizer, renderer).generate(qs[:1], greedy).samples[0]
    tight = full.turns[0].end + 3
    cut = (
        rollout(model, tokenizer, renderer)
        .generate(qs[:1], SamplingConfig(temperature=0, max_new_tokens=tight))
        .samples[0]
    )
    assert cut.finish_reason == "length" and [t.role for t in cut.turns] == ["assistant", "tool"]
    assert cut.response_token_ids == full.response_token_ids[:tight]
    assert cut.turns[1].calls == 1 and cut.loss_mask[full.turns[0].end :] == (0, 0, 0)
    # budget spent inside the first turn: cut like a single-turn sample
    short = (
        rollout(model, tokenizer, renderer)
        .generate(qs[:1], SamplingConfig(temperature=0, max_new_tokens=5))
        .samples[0]
    )
    assert short.finish_reason == "length" and len(short.response_token_ids) == 5


def test_unknown_agent_name_is_refused_before_generating(model, tokenizer, renderer):
    mt = rollout(model, tokenizer, renderer)
    with pytest.raises(ValueError, match="agent_name 'coder' is not one of"):
        mt.generate(prompts(tokenizer)[:1], SamplingConfig(), contexts=[{"agent_name": "coder"}])


def test_hf_engine_caps_each_prompt(tokenizer):
    engine = engine_for(chat_model(tokenizer, seed=2))
    qs = prompts(tokenizer)
    sampling = SamplingConfig(max_new_tokens=12, seed=0, ignore_eos=True)
    whole = engine.generate(qs, sampling)
    capped = engine.generate(qs, sampling, max_new_tokens=[3, 12, 7, 1])
    for a, b, cap in zip(whole.samples, capped.samples, [3, 12, 7, 1], strict=False):
        assert b.response_token_ids == a.response_token_ids[:cap]
        assert b.finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate(qs, sampling, max_new_tokens=[0, 1, 1, 1])


def test_renderer_refuses_a_template_that_is_not_prefix_preserving(tokenizer):
    class Rerenders:
        """Drops earlier assistant turns once a later turn exists (Qwen3 drops <think>)."""

        eos_token_id = tokenizer.eos_token_id

        def decode(self, ids):
            return tokenizer.decode(ids)

        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            if len(messages) > 2:
                messages = [
                    m if m["role"] != "assistant" else {**m, "content": ""} for m in messages
                ]
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )

    with pytest.raises(ValueError, match="not prefix-preserving"):
        TurnRenderer(Rerenders())
