"""Tools, their box and the hermes parser: every failure an answer, counted by kind."""

import threading
import time

import pytest

from rollout import (
    TOOL_CALL_FORMATS,
    Calculator,
    HermesParser,
    MultiTurnConfig,
    ToolBox,
    ToolCall,
    ToolEnvironment,
    ToolResult,
    check_tool_schema,
)
from rollout.calculator import CalculatorError, evaluate
from rollout.tools import truncate


@pytest.mark.parametrize(
    "expression, value",
    [
        ("23 * 47", 1081),
        ("(1 + 2) * 3 - 4 / 2", 7.0),
        ("-3 ** 2", -9),
        ("7 // 2 + 7 % 2", 4),
        ("2 ^ 10", 1024),
        ("12 × 3", 36),
        ("1.5 * 4", 6.0),
    ],
)
def test_calculator_values(expression, value) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, says",
    [
        ("__import__('os').system('true')", "unsupported element"),
        ("open('x')", "unsupported element"),
        ("a + 1", "unsupported element"),
        ("(1).real", "unsupported element"),
        ("'a' * 3", "unsupported element"),
        ("[1, 2][0]", "unsupported element"),
        ("9 ** 9 ** 9", "exponent"),  # would run for hours under eval
        ("10 ** 40", "too large"),
        ("1e300 * 1e300", "too large"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than"),
        ("", "empty"),
    ],
)
def test_calculator_refuses(expression, says) -> None:
    with pytest.raises(CalculatorError, match=says):
        evaluate(expression)


def test_calculator_tool_answers_errors_as_text() -> None:
    calc = Calculator()
    assert calc.call({"expression": "6 * 7"}, {}) == ToolResult("42")
    assert calc.call({"expression": "2.5 * 2"}, {}).text == "5"
    refused = calc.call({"expression": "x"}, {})
    assert refused.error == "tool_error" and refused.text.startswith("Error: unsupported")
    check_tool_schema(calc.schema, "calculator")


def test_hermes_parser() -> None:
    parse = HermesParser().parse
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    assert parse("no call here") == []
    [one] = parse("Let me compute. " + call)
    assert (one.name, one.arguments, one.error) == ("calculator", {"expression": "2*3"}, None)
    assert len(parse(call + call)) == 2
    # OpenAI-style arguments as a JSON string
    [s] = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert s.arguments == {"a": 1}
    for text, says in [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>["calculator"]</tool_call>', '"name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', "without </tool_call>"),
    ]:
        [bad] = parse(text)
        assert bad.error is not None and says in bad.error, (text, bad)
    # a closed call then an unclosed one: both reported
    assert [c.error is None for c in parse(call + "<tool_call>{")] == [True, False]
    assert TOOL_CALL_FORMATS["hermes"] is HermesParser


def test_truncate_sides() -> None:
    text = "abcdefghij"
    assert truncate(text, 20, "left") == text
    assert truncate(text, 4, "left") == "abcd...(truncated)"
    assert truncate(text, 4, "right") == "(truncated)...ghij"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 5, "middle") == "ab...(truncated)...hij"


class Raises:
    name = "raises"
    schema = {"type": "function", "function": {"name": "raises", "parameters": {"type": "object"}}}

    def call(self, arguments, context):
        raise RuntimeError("boom")


class Hangs:
    name = "hangs"
    schema = {"type": "function", "function": {"name": "hangs", "parameters": {"type": "object"}}}

    def __init__(self):
        self.release = threading.Event()

    def call(self, arguments, context):
        self.release.wait(30)
        return "late"


class Chatty:
    name = "chatty"
    schema = {"type": "function", "function": {"name": "chatty"}}

    def call(self, arguments, context):
        return "x" * 10_000 + context.get("suffix", "")


def test_every_failure_is_an_answer_and_counted() -> None:
    hangs = Hangs()
    box = ToolBox([Calculator(), Raises(), hangs, Chatty()], timeout_s=0.5, max_response_chars=120)
    calls = [
        ToolCall("calculator", {"expression": "6*7"}),
        ToolCall(None, None, "{oops", "the tool call is not valid JSON"),
        ToolCall("nope", {}),
        ToolCall("calculator", {"expr": "1"}),  # wrong argument name
        ToolCall("calculator", {"expression": 5}),  # wrong type
        ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("raises", {}),
        ToolCall("hangs", {}),
        ToolCall("chatty", {}),
    ]
    start = time.perf_counter()
    results = box.run(calls, [{}] * len(calls))
    waited = time.perf_counter() - start
    hangs.release.set()
    assert waited < 5  # one time limit for the whole turn, not one per call
    assert results[0] == ToolResult("42")
    assert [r.error for r in results] == [
        None,
        "malformed",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "tool_error",
        "raised",
        "timeout",
        None,
    ]
    assert "unknown tool 'nope'" in results[2].text and "calculator" in results[2].text
    assert "'expression' is a required property" in results[3].text
    assert "RuntimeError: boom" in results[6].text
    assert "timed out after 0.5 s" in results[7].text
    assert len(results[8].text) < 150 and "(truncated)" in results[8].text
    assert all(len(r.text) < 200 for r in results)
    assert box.counts["calls"] == 9 and box.counts["truncated"] == 1
    assert box.counts["error/bad_arguments"] == 2 and box.counts["error/timeout"] == 1
    # the box still answers after a hung call took a worker
    assert box.run([ToolCall("calculator", {"expression": "1+1"})], [{}])[0].text == "2"
    box.close()


def test_context_reaches_the_tool_by_name() -> None:
    box = ToolBox([Chatty()], max_response_chars=20_000)
    [r] = box.run([ToolCall("chatty", {})], [{"chatty": {"suffix": "END"}}])
    assert r.text.endswith("END")


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "function"}, "function.name"),
        ({"function": {"name": 3}}, "function.name"),
        ({"function": {"name": "f", "parameters": {"type": "no-such-type"}}}, "not a JSON schema"),
        ({"function": {"name": "f", "parameters": {"type": "array"}}}, "describe an object"),
    ],
)
def test_bad_schemas_are_refused(schema, says) -> None:
    with pytest.raises(ValueError, match=says):
        check_tool_schema(schema, "tool f")


def test_duplicate_tool_names_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        ToolBox([Calculator(), Calculator()])


def test_tool_environment_answers_the_first_calls() -> None:
    env = ToolEnvironment(ToolBox([Calculator()]), HermesParser(), max_parallel_calls=2)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    texts = [call % "1+1" + call % "2*3" + call % "9-1", "The answer is 4.", call % "x"]
    assert [env.wants_turn(t, {}) for t in texts] == [True, False, True]
    a, b = env.respond([texts[0], texts[2]], [{}, {}])
    assert [m["content"] for m in a.messages] == ["2", "6"]  # the third call is not run
    assert a.calls == 2 and a.errors == () and {m["role"] for m in a.messages} == {"tool"}
    assert b.calls == 1 and b.errors == ("tool_error",)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_assistant_turns", 0),
        ("max_parallel_calls", 0),
        ("max_tool_response_length", 0),
        ("tool_response_truncate_side", "top"),
        ("format", "xml"),
        ("tool_timeout_s", 0),
    ],
)
def test_multi_turn_config_checks(field, value) -> None:
    with pytest.raises(ValueError, match=f"MultiTurnConfig.{field}"):
        MultiTurnConfig(**{field: value})


def test_tool_environment_from_config_takes_every_field() -> None:
    config = MultiTurnConfig(
        max_parallel_calls=2,
        max_tool_response_length=7,
        tool_response_truncate_side="left",
        tool_timeout_s=0.25,
    )
    env = ToolEnvironment.from_config([Calculator()], config)
    assert isinstance(env.parser, HermesParser) and env.max_parallel_calls == 2
    box = env.toolbox
    assert (box.timeout_s, box.max_response_chars, box.truncate_side) == (0.25, 7, "left")
    [r] = box.run([ToolCall("nope", {})], [{}])
    assert r.text.startswith("Error: ") and r.text.endswith("...(truncated)")
