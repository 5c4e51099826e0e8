"""Tools a policy calls inside a multi-turn rollout, and the box that runs them.

A tool is a name, an OpenAI-style function schema (``{"type": "function", "function":
{"name", "description", "parameters": <JSON schema>}}``, the shape chat templates and verl's
tool-config files use) and a ``call(arguments, context)`` that returns text, optionally
with a reward. :class:`ToolBox` runs a turn's calls: it checks each call's arguments
against its schema, runs it with a time limit, truncates what it returns, and turns every
failure into a bounded answer the model sees (never an exception), counted by kind.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# The kinds of failure a call can end in (ToolResult.error), as counted in the metrics.
TOOL_ERRORS = (
    "malformed",  # the call's text did not parse (not JSON, no name, arguments not an object)
    "unknown_tool",
    "bad_arguments",  # the arguments do not satisfy the tool's JSON schema
    "tool_error",  # the tool refused the input (its own error text)
    "raised",  # the tool raised an exception
    "timeout",
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments`` as parsed, or ``error`` (the
    text did not parse: then ``raw`` is what the model wrote)."""

    name: str | None
    arguments: Mapping[str, Any] | None
    raw: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a tool answers: ``text`` (what the model reads next), an optional ``reward``,
    and ``error``: None, or one of :data:`TOOL_ERRORS` when the call failed."""

    text: str
    reward: float | None = None
    error: str | None = None


@runtime_checkable
class Tool(Protocol):
    """A tool: ``name``, ``schema`` (OpenAI function schema), and ``call``, which gets the
    parsed arguments (checked against the schema) and the row's context (verl's
    ``extra_info.tools_kwargs[name]``) and returns a :class:`ToolResult` or a string."""

    name: str
    schema: Mapping[str, Any]

    def call(
        self, arguments: Mapping[str, Any], context: Mapping[str, Any]
    ) -> ToolResult | str: ...


def check_tool_schema(schema: Mapping[str, Any], where: str) -> None:
    """Refuse a tool schema that is not ``{"type": "function", "function": {"name": str,
    "parameters": <a JSON schema>}}``; ``where`` names it in the message."""
    import jsonschema

    function = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: a tool schema needs function.name (a string)")
    parameters = function.get("parameters", {"type": "object"})
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as error:
        message = f"{where}: function.parameters is not a JSON schema: {error.message}"
        raise ValueError(message) from None
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f"{where}: function.parameters must describe an object")


def truncate(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters as verl does: ``left`` keeps the start,
    ``right`` the end, ``middle`` both halves; a marker says it was cut."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half) :]


@dataclass
class ToolBox:
    """The tools of a rollout, by name, and how their calls run.

    Args:
        tools: the tools (names unique).
        timeout_s: a call running longer is answered ``timeout`` (its thread is left to
            finish; a tool that may hang for good belongs in its own process).
        max_response_chars: answers are truncated to this many characters (verl's
            ``max_tool_response_length``), on ``truncate_side``.
        max_workers: calls run at once (threads).
    """

    tools: Sequence[Tool]
    timeout_s: float = 10.0
    max_response_chars: int = 256
    truncate_side: str = "middle"
    max_workers: int = 8
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tools}
        if len(self.by_name) != len(self.tools):
            raise ValueError(f"tool names must be unique, got {[t.name for t in self.tools]}")
        for tool in self.tools:
            check_tool_schema(tool.schema, f"tool {tool.name!r}")
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, "klppo-tool")

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's ``tools=``."""
        return [dict(t.schema) for t in self.tools]

    def run(
        self, calls: Sequence[ToolCall], contexts: Sequence[Mapping[str, Any]]
    ) -> list[ToolResult]:
        """Each call's result (calls of many conversations run at once; ``contexts[i]``
        is call i's row context), every failure an answer, counted in :attr:`counts`."""
        futures = [
            self._pool.submit(self._call, c, ctx) for c, ctx in zip(calls, contexts, strict=False)
        ]
        done, late = concurrent.futures.wait(futures, timeout=self.timeout_s)
        results = [
            future.result() if future in done else self._timed_out(call, future)
            for call, future in zip(calls, futures, strict=False)
        ]
        if late:  # their threads cannot be stopped: leave them, start a fresh pool
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, "klppo-tool")
        return [self._bounded(r) for r in results]

    def _timed_out(self, call: ToolCall, future: concurrent.futures.Future) -> ToolResult:
        future.cancel()
        return ToolResult(
            f"Error: {call.name} timed out after {self.timeout_s:g} s", error="timeout"
        )

    def _call(self, call: ToolCall, context: Mapping[str, Any]) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"Error: {call.error}", error="malformed")
        tool = self.by_name.get(call.name)
        if tool is None:
            known = ", ".join(self.by_name) or "none"
            return ToolResult(
                f"Error: unknown tool {call.name!r} (tools: {known})", error="unknown_tool"
            )
        problem = _argument_problem(tool, call.arguments)
        if problem:
            return ToolResult(f"Error: {problem}", error="bad_arguments")
        try:
            answer = tool.call(call.arguments, context.get(tool.name, {}) if context else {})
        except Exception as error:  # the model sees it; the run goes on
            return ToolResult(f"Error: {type(error).__name__}: {error}", error="raised")
        return answer if isinstance(answer, ToolResult) else ToolResult(str(answer))

    def _bounded(self, result: ToolResult) -> ToolResult:
        self.counts["calls"] += 1
        if result.error:
            self.counts[f"error/{result.error}"] += 1
        text = truncate(result.text, self.max_response_chars, self.truncate_side)
        if text != result.text:
            self.counts["truncated"] += 1
            return ToolResult(text, result.reward, result.error)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _argument_problem(tool: Tool, arguments: Mapping[str, Any] | None) -> str | None:
    import jsonschema

    parameters = tool.schema["function"].get("parameters", {"type": "object"})
    try:
        jsonschema.validate(arguments if arguments is not None else {}, parameters)
    except jsonschema.ValidationError as error:
        return f"bad arguments for {tool.name}: {error.message}"
    return None
