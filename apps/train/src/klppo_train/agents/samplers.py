"""What turns a batch of prompts into samples: a :class:`Sampler`. The engine's single turn
(:class:`SingleTurn`), or conversations with tools (:class:`MultiTurn`,
``rollout.multi_turn.enable``) over the same engine. Training, validation and ReMax's
greedy baselines all sample through the run's one sampler, so validation runs the same
multi-turn rollout as training.

The agents a row picks by its ``agent_name`` (verl's column): ``tool_agent`` (the default
with multi-turn on: tool calls answered by the configured tools) and ``single_turn_agent``
(one assistant turn, never answered).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from klppo_train.data.datasets import SINGLE_TURN_AGENT, TOOL_AGENT, PromptItem
from rollout import (
    TOOL_ERRORS,
    MultiTurnConfig,
    MultiTurnRollout,
    RolloutBatch,
    RolloutEngine,
    SamplingConfig,
    Tool,
    ToolEnvironment,
    TurnRenderer,
    multi_turn_metrics,
)


class Sampler(Protocol):
    """``sample(items, sampling, seeds)``: ``sampling.n`` samples per item, contiguous, in
    item order (``seeds[i]``: item i's request seed); ``metrics(batch)``: what the sampling
    did, as step metrics (per-sample means); ``close()``: what it started (tool threads);
    ``multi_turn``: whether its samples are conversations (with turns)."""

    multi_turn: bool

    def sample(
        self, items: Sequence[PromptItem], sampling: SamplingConfig, seeds=None
    ) -> RolloutBatch: ...

    def metrics(self, batch: RolloutBatch) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass
class SingleTurn:
    """One generated turn per sample: the engine itself."""

    engine: RolloutEngine
    multi_turn = False

    def sample(self, items, sampling, seeds=None) -> RolloutBatch:
        return self.engine.generate([list(i.prompt_ids) for i in items], sampling, seeds=seeds)

    def metrics(self, batch: RolloutBatch) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None


class _SingleTurnAgent:
    """verl's ``single_turn_agent``: the first assistant turn ends the conversation."""

    def wants_turn(self, text: str, context: Mapping[str, Any]) -> bool:
        return False

    def respond(self, texts, contexts):  # never asked: wants_turn is False
        raise AssertionError("a single-turn agent is never asked to respond")


@dataclass
class MultiTurn:
    """Conversations with tools over the engine (:class:`rollout.MultiTurnRollout`): each
    item's ``agent_name`` picks its agent, its ``extra_info.tools_kwargs`` is what its tool
    calls get; metrics ``multi_turn/*`` and ``tool/*`` per sample."""

    rollout: MultiTurnRollout
    environment: ToolEnvironment
    multi_turn = True

    @classmethod
    def build(
        cls,
        engine: RolloutEngine,
        tokenizer,
        tools: Sequence[Tool],
        config: MultiTurnConfig,
    ) -> MultiTurn:
        environment = ToolEnvironment.from_config(tools, config)
        agents = {TOOL_AGENT: environment, SINGLE_TURN_AGENT: _SingleTurnAgent()}
        rollout = MultiTurnRollout(
            engine, TurnRenderer(tokenizer), decoder(tokenizer), agents, config
        )
        return cls(rollout, environment)

    def sample(self, items, sampling, seeds=None) -> RolloutBatch:
        contexts = [
            {"agent_name": i.agent_name, "tools_kwargs": i.extra_info.get("tools_kwargs") or {}}
            for i in items
        ]
        prompts = [list(i.prompt_ids) for i in items]
        return self.rollout.generate(prompts, sampling, seeds=seeds, contexts=contexts)

    def metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Every kind of tool failure is reported, 0 when none happened, so that the ranks'
        metrics have the same keys (their mean is the mean over all samples)."""
        return {f"tool/errors/{k}": 0.0 for k in TOOL_ERRORS} | multi_turn_metrics(batch.samples)

    def close(self) -> None:
        self.environment.toolbox.close()


def decoder(tokenizer):
    """``ids -> text`` as the agents and the logs read a turn: special tokens skipped."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def conversation(sample, decode) -> list[dict[str, str]]:
    """A sample's response as ``[{role, content}]``, turn by turn (one assistant turn for
    a single-turn sample); ``decode(ids)``: the tokenizer's, special tokens skipped."""
    ids = sample.response_token_ids
    if not sample.turns:
        return [{"role": "assistant", "content": decode(ids)}]
    return [{"role": t.role, "content": decode(ids[t.start : t.end])} for t in sample.turns]
