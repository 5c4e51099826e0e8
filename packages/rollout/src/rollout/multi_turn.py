"""Multi-turn rollouts above any :class:`~rollout.protocol.RolloutEngine`: generate, let the
environment answer (parse the tool calls, run the tools), append its answer, generate
again, until the model answers without a call, a turn limit comes or the response budget
is spent.

Token in, token out: a conversation's response is exactly the ids the engine returned for
each assistant turn (its stop token included) and, between them, the ids of the appended
turns rendered once (:class:`~rollout.chat.TurnRenderer`); the next turn's prompt is the
prompt's ids plus all of those. No text is ever tokenized again. Each sample carries the
loss mask (1 on generated tokens, 0 on appended ones), the engine's log-probs (0 on
appended tokens), its turns (:class:`~rollout.types.Turn`: role, span, policy version,
calls, errors) and a finish reason (``stop``, ``length``, ``max_turns``).

All live conversations advance together: one engine call per turn (the first with the
prompts and ``n`` samples each, as a single-turn rollout: a conversation without a call is
the single-turn sample; later ones one request per conversation), so vLLM's prefix cache
reuses each conversation's history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rollout.config import MultiTurnConfig, SamplingConfig
from rollout.environments import Environment, Observation
from rollout.protocol import RolloutEngine
from rollout.types import RolloutBatch, Sample, Turn

DEFAULT_AGENT = "tool_agent"  # verl's agent_name for tool calling


@dataclass(eq=False)
class _Conversation:
    sample_index: int  # among its prompt's n
    prompt_index: int
    prompt: list[int]
    context: Mapping[str, Any]
    agent: str
    budget: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish: str | None = None

    @property
    def assistant_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    @property
    def user_turns(self) -> int:  # appended turns: verl counts tool answers as user turns
        return len(self.turns) - self.assistant_turns

    def generated(self, sample: Sample) -> None:
        start = len(self.ids)
        self.ids += sample.response_token_ids
        self.logprobs += sample.logprobs
        self.mask += [1] * len(sample.response_token_ids)
        self.turns.append(Turn("assistant", start, len(self.ids), sample.policy_version))
        if sample.finish_reason == "length" or len(self.ids) >= self.budget:
            self.finish = "length"

    def appended(self, ids: list[int], observation: Observation) -> None:
        start = len(self.ids)
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        roles = {m.get("role", "tool") for m in observation.messages}
        role = roles.pop() if len(roles) == 1 else "tool"
        version = self.turns[-1].policy_version
        turn = Turn(
            role,
            start,
            len(self.ids),
            version,
            observation.calls,
            observation.errors,
            observation.reward,
        )
        self.turns.append(turn)

    def sample(self) -> Sample:
        return Sample(
            self.prompt_index,
            tuple(self.ids),
            tuple(self.logprobs),
            self.finish or "stop",
            self.turns[0].policy_version,
            loss_mask=tuple(self.mask),
            turns=tuple(self.turns),
        )


class MultiTurnRollout:
    """Multi-turn generation over ``engine``.

    Args:
        engine: any :class:`RolloutEngine` (generates token ids; per-request seeds and
            ``max_new_tokens`` per prompt).
        renderer: renders appended turns to ids (:class:`~rollout.chat.TurnRenderer`).
        decode: token ids → text (the tokenizer's ``decode``, special tokens skipped): what
            the environment reads of an assistant turn.
        environments: by ``agent_name``; a row's ``context["agent_name"]`` picks one
            (default :data:`DEFAULT_AGENT`). An unknown name raises before any generation.
        config: turn limits and tool-answer bounds.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        renderer,
        decode: Callable[[Sequence[int]], str],
        environments: Mapping[str, Environment],
        config: MultiTurnConfig | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.decode = decode
        self.environments = dict(environments)
        self.config = config or MultiTurnConfig()

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        contexts: Sequence[Mapping[str, Any]] | None = None,
    ) -> RolloutBatch:
        """``sampling.n`` conversations per prompt (contiguous, in prompt order), each a
        :class:`Sample` whose response holds every turn after the prompt, at most
        ``sampling.max_new_tokens`` tokens in all (verl's ``response_length``).
        ``contexts[i]``: prompt i's ``agent_name`` and ``tools_kwargs``."""
        contexts = list(contexts) if contexts is not None else [{}] * len(prompt_token_ids)
        if len(contexts) != len(prompt_token_ids):
            raise ValueError(f"{len(contexts)} contexts for {len(prompt_token_ids)} prompts")
        convs = [
            self._conversation(i, j, prompt, contexts[i], sampling.max_new_tokens)
            for i, prompt in enumerate(prompt_token_ids)
            for j in range(sampling.n)
        ]
        first = self.engine.generate(prompt_token_ids, sampling, seeds=seeds)
        for conv, sample in zip(convs, first.samples, strict=True):
            conv.generated(sample)
        turn = 1
        while live := self._answer([c for c in convs if c.finish is None]):
            batch = self.engine.generate(
                [c.prompt + c.ids for c in live],
                replace(sampling, n=1),
                seeds=self._turn_seeds(live, sampling, seeds, turn),
                max_new_tokens=[c.budget - len(c.ids) for c in live],
            )
            for conv, sample in zip(live, batch.samples, strict=True):
                conv.generated(sample)
            turn += 1
        return RolloutBatch([c.sample() for c in convs], first.policy_version)

    def _conversation(self, index, sample_index, prompt, context, budget) -> _Conversation:
        agent = context.get("agent_name") or DEFAULT_AGENT
        if agent not in self.environments:
            raise ValueError(
                f"prompt {index}: agent_name {agent!r} is not one of {sorted(self.environments)}"
            )
        tools_kwargs = context.get("tools_kwargs") or {}
        return _Conversation(sample_index, index, list(prompt), tools_kwargs, agent, budget)

    def _answer(self, waiting: list[_Conversation]) -> list[_Conversation]:
        """The environment's answers to ``waiting``'s last assistant turns, appended;
        returns the conversations that go on (the others get their finish reason)."""
        asking = []
        for conv in waiting:
            text = self.decode(conv.ids[conv.turns[-1].start :])
            if not self.environments[conv.agent].wants_turn(text, conv.context):
                conv.finish = "stop"
            elif self._at_limit(conv):
                conv.finish = "max_turns"
            else:
                asking.append((conv, text))
        go_on = []
        for agent, env in self.environments.items():
            mine = [(c, t) for c, t in asking if c.agent == agent]
            if not mine:
                continue
            answers = env.respond([t for _, t in mine], [c.context for c, _ in mine])
            for (conv, _), observation in zip(mine, answers, strict=True):
                ids = self.renderer.ids(observation.messages)
                room = conv.budget - len(conv.ids)
                if len(ids) >= room:  # no token left to answer: cut at the budget, as verl
                    conv.appended(ids[:room], observation)  # cuts a response; calls counted
                    conv.finish = "length"
                    continue
                conv.appended(ids, observation)
                go_on.append(conv)
        place = {id(c): i for i, c in enumerate(waiting)}
        return sorted(go_on, key=lambda c: place[id(c)])

    def _at_limit(self, conv: _Conversation) -> bool:
        c = self.config
        return (
            c.max_assistant_turns is not None and conv.assistant_turns >= c.max_assistant_turns
        ) or (c.max_user_turns is not None and conv.user_turns >= c.max_user_turns)

    @staticmethod
    def _turn_seeds(live, sampling: SamplingConfig, seeds, turn: int):
        """Turn ``turn``'s seed of each live conversation: a function of its prompt's seed,
        its sample index and the turn, so a conversation does not depend on the others."""
        if seeds is None and sampling.seed is None:
            return None
        out = []
        for conv in live:
            base = seeds[conv.prompt_index] if seeds is not None else sampling.seed
            out.append((base * 1_000_003 + conv.sample_index * 1009 + turn) % 2**62)
        return out


def multi_turn_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-sample means over multi-turn samples: ``multi_turn/turns`` (all turns),
    ``multi_turn/assistant_turns``, ``tool/calls_per_sample``, ``tool/error_rate`` (failed
    calls / calls), ``tool/errors/<kind>`` (per sample), ``multi_turn/finish/<reason>``
    (fractions), ``multi_turn/tool_tokens`` (appended tokens per sample)."""
    n = max(len(samples), 1)
    turns = [t for s in samples for t in s.turns]
    calls = sum(t.calls for t in turns)
    errors = [e for t in turns for e in t.errors]
    out = {
        "multi_turn/turns": len(turns) / n,
        "multi_turn/assistant_turns": sum(t.role == "assistant" for t in turns) / n,
        "multi_turn/tool_tokens": sum(t.end - t.start for t in turns if t.role != "assistant") / n,
        "tool/calls_per_sample": calls / n,
        "tool/error_rate": len(errors) / calls if calls else 0.0,
    }
    for kind in sorted(set(errors)):
        out[f"tool/errors/{kind}"] = errors.count(kind) / n
    for reason in ("stop", "length", "max_turns"):
        out[f"multi_turn/finish/{reason}"] = sum(s.finish_reason == reason for s in samples) / n
    return out
