"""What answers an assistant turn in a multi-turn rollout: an :class:`Environment`.

The built-in one, :class:`ToolEnvironment`, parses the turn's tool calls and answers them
with a :class:`~rollout.tools.ToolBox`. A task that is not tool calling (a simulated user,
a game) is another object behind the same Protocol, picked per data row by its
``agent_name`` (verl's column).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollout.tool_parsers import ToolCallParser
from rollout.tools import ToolBox


@dataclass(frozen=True)
class Observation:
    """The turns appended after an assistant turn: ``messages`` (chat messages, role
    ``tool`` or ``user``), the tool ``calls`` they answer, the ``errors`` among those
    (kinds of :data:`rollout.tools.TOOL_ERRORS`) and a ``reward``."""

    messages: tuple[Mapping[str, Any], ...]
    calls: int = 0
    errors: tuple[str, ...] = ()
    reward: float = 0.0


@runtime_checkable
class Environment(Protocol):
    """Answers assistant turns, many conversations at once.

    Contract: ``wants_turn(text, context)`` says whether the assistant turn ``text`` asks
    for an answer (a tool call; a user simulator that has more to say) — False ends the
    conversation (``stop``). ``respond(texts, contexts)`` answers those turns, one
    :class:`Observation` each, in order; it never raises for anything the model wrote
    (that is an observation). ``contexts[i]``: the data row's ``tools_kwargs``."""

    def wants_turn(self, text: str, context: Mapping[str, Any]) -> bool: ...

    def respond(
        self, texts: Sequence[str], contexts: Sequence[Mapping[str, Any]]
    ) -> list[Observation]: ...


@dataclass
class ToolEnvironment:
    """Tool calling: the calls of each turn (the first ``max_parallel_calls``), parsed by
    ``parser``, run by ``toolbox`` (all conversations' calls at once), each answer a
    ``tool`` message."""

    toolbox: ToolBox
    parser: ToolCallParser
    max_parallel_calls: int = 1

    @classmethod
    def from_config(cls, tools, config) -> ToolEnvironment:
        """``tools`` answered as a :class:`~rollout.config.MultiTurnConfig` says (its
        format, parallel calls, time limit, answer length and truncation side)."""
        from rollout.tool_parsers import TOOL_CALL_FORMATS

        box = ToolBox(
            tools,
            timeout_s=config.tool_timeout_s,
            max_response_chars=config.max_tool_response_length,
            truncate_side=config.tool_response_truncate_side,
        )
        return cls(box, TOOL_CALL_FORMATS[config.format](), config.max_parallel_calls)

    def wants_turn(self, text: str, context: Mapping[str, Any]) -> bool:
        return bool(self.parser.parse(text))

    def respond(
        self, texts: Sequence[str], contexts: Sequence[Mapping[str, Any]]
    ) -> list[Observation]:
        per_turn = [self.parser.parse(text)[: self.max_parallel_calls] for text in texts]
        calls = [call for turn in per_turn for call in turn]
        owners = [ctx for turn, ctx in zip(per_turn, contexts, strict=False) for _ in turn]
        results = iter(self.toolbox.run(calls, owners))
        out = []
        for turn in per_turn:
            answers = [next(results) for _ in turn]
            out.append(
                Observation(
                    messages=tuple({"role": "tool", "content": a.text} for a in answers),
                    calls=len(answers),
                    errors=tuple(a.error for a in answers if a.error),
                    reward=sum(a.reward or 0.0 for a in answers),
                )
            )
        return out
