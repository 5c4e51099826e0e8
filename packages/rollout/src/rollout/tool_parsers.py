"""How tool calls are read from an assistant turn's text: the ``hermes`` format (Qwen2.5,
Hermes, SmolLM3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and the
registry other formats join (:data:`TOOL_CALL_FORMATS`, keyed by verl's
``multi_turn.format`` names)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import Protocol

from rollout.tools import ToolCall


class ToolCallParser(Protocol):
    """``parse(text)``: the calls in one assistant turn, in order; a call whose text does not
    parse is a :class:`ToolCall` with ``error`` set (it is answered, never dropped)."""

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per turn.

    Malformed: a body that is not a JSON object, without a string ``name``, with
    ``arguments`` that are not an object (a JSON string holding one is accepted, as
    OpenAI's API sends them), or an opening tag that is never closed. verl's parser drops
    such calls silently; here each becomes an answer the model sees."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = [_call(body.strip()) for body in self._CALL.findall(text)]
        tail = text[text.rfind(self.CLOSE) + len(self.CLOSE) :] if calls else text
        if self.OPEN in tail:  # an opening tag after the last closed call
            raw = tail[tail.index(self.OPEN) :]
            calls.append(ToolCall(None, None, raw, "a <tool_call> without </tool_call>"))
        return calls


def _call(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, body, f"the tool call is not valid JSON ({error.msg})")
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return ToolCall(None, None, body, 'a tool call needs "name" (a string)')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, Mapping):
        return ToolCall(value["name"], None, body, '"arguments" must be a JSON object')
    return ToolCall(value["name"], dict(arguments), body)


# verl's multi_turn.format name -> parser class
TOOL_CALL_FORMATS: dict[str, type] = {"hermes": HermesParser}
