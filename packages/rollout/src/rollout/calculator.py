"""A calculator tool that evaluates arithmetic with a parser, never ``eval``.

The expression is parsed by Python's own grammar (:func:`ast.parse`, which builds a tree and
runs nothing) and the tree is walked here, node by node, accepting only numbers, ``+ - * /
// % **``, unary signs and parentheses. Everything else (names, calls, attributes,
subscripts, strings) is refused with a message the model sees. The sizes that could make a
single call expensive are bounded: the expression's length, an exponent's magnitude and
every intermediate result's size.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from typing import Any

from rollout.tools import ToolResult

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; its message is what the model is told."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (``"12 * (3 + 4) / 2"``).

    Raises:
        CalculatorError: anything but numbers and ``+ - * / // % **`` with parentheses, a
            division by zero, an exponent above ``MAX_EXPONENT``, a result above
            ``MAX_MAGNITUDE``, or an expression longer than ``MAX_EXPRESSION_CHARS``.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("×", "*").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):
            raise CalculatorError("result is not a real number")
        return _bounded(result)
    raise CalculatorError(f"unsupported element: {ast.unparse(node)!r}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def format_number(value: int | float) -> str:
    """``12`` for integers and integral floats, else up to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class Calculator:
    """The built-in tool ``calculator``: ``{"expression": "<arithmetic>"}`` → its value.

    Args:
        name: the name the model calls (the schema's ``function.name``).
    """

    description = (
        "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. '23 * 47'."
    )

    def __init__(self, name: str = "calculator", schema: Mapping[str, Any] | None = None):
        self.name = name
        self.schema = dict(schema) if schema else self.default_schema(name)

    @classmethod
    def default_schema(cls, name: str = "calculator") -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": cls.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "the arithmetic expression, e.g. '23 * 47'",
                        }
                    },
                    "required": ["expression"],
                },
            },
        }

    def call(self, arguments: Mapping[str, Any], context: Mapping[str, Any]) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(arguments["expression"])))
        except CalculatorError as error:
            return ToolResult(f"Error: {error}", error="tool_error")
