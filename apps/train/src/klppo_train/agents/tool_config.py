"""verl's tool-config file (``rollout.multi_turn.tool_config_path``), loaded as is::

    tools:
      - class_name: calculator                  # a built-in, "pkg.module.Class" or "file.py:Class"
        config: {type: native}                  # handed to the class
        tool_schema:                            # OpenAI function schema; optional for a built-in
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

A built-in is named by its short name or its module path (``calculator``,
``rollout.calculator.Calculator``). Any other class is the user's (their code runs, as a
custom reward's does): it is called as ``cls(config=<config>, tool_schema=<tool_schema>)``
(verl's ``BaseTool`` constructor) and must give a :class:`rollout.tools.Tool` (``name``,
``schema``, ``call(arguments, context)``). Everything is checked here, before any model
loads: the file parses, each entry names a class that exists, its schema is a JSON schema,
the tool is built and its name is unique.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from klppo_train.data.user_code import load_user_file
from rollout.calculator import Calculator
from rollout.tools import Tool, check_tool_schema


def _calculator(config: Mapping[str, Any], tool_schema: Mapping[str, Any] | None) -> Tool:
    if tool_schema:
        return Calculator(tool_schema["function"]["name"], tool_schema)
    return Calculator()


# class_name → (config, tool_schema or None) -> Tool
BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    name: _calculator
    for name in ("calculator", "Calculator", "rollout.Calculator", "rollout.calculator.Calculator")
}


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of a verl tool-config file, built and checked.

    Raises:
        ValueError: ``"<path>: tools[i]: ..."`` for a file that does not parse or an entry
            that is not a tool (unknown class, bad schema, a class that fails to build or
            does not satisfy :class:`rollout.tools.Tool`, a repeated name).
        FileNotFoundError: the file does not exist.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tool config {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not YAML: {error}") from None
    entries = loaded.get("tools") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: needs a non-empty list 'tools: [{{class_name, ...}}]'")
    tools = [_tool(entry, f"{path}: tools[{i}]", path.parent) for i, entry in enumerate(entries)]
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: tool names must be unique, {repeated} repeat")
    return tools


def _tool(entry: Any, where: str, base: Path) -> Tool:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: needs class_name (a string)")
    config = entry.get("config") or {}
    schema = entry.get("tool_schema")
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config must be a mapping, got {config!r}")
    if schema is not None:
        check_tool_schema(schema, where)
    name = entry["class_name"]
    if name in BUILTIN_TOOLS:
        tool = BUILTIN_TOOLS[name](config, schema)
    else:
        if schema is None:
            raise ValueError(f"{where}: a tool of your own ({name}) needs its tool_schema")
        tool = _built(_user_class(name, where, base), config, schema, where)
    if not isinstance(tool, Tool):
        raise ValueError(f"{where}: {name} gives no tool (name, schema, call(arguments, context))")
    check_tool_schema(tool.schema, where)
    if schema is not None and tool.name != schema["function"]["name"]:
        raise ValueError(
            f"{where}: the tool is named {tool.name!r}, its schema {schema['function']['name']!r}"
        )
    return tool


def _built(cls: type, config: dict, schema: dict, where: str) -> Tool:
    try:
        return cls(config=config, tool_schema=schema)
    except Exception as error:  # the user's constructor: its failure names the entry
        raise ValueError(f"{where}: {cls.__name__}(config, tool_schema) failed: {error}") from None


def _user_class(spec: str, where: str, base: Path) -> type:
    """``"pkg.module.Class"`` (importable) or ``"path/to/file.py:Class"`` (relative to the
    tool-config file's folder when not found from the working directory)."""
    path_str, sep, attr = spec.rpartition(":")
    if sep:
        file = Path(path_str).expanduser()
        file = file if file.is_file() else base / file
        if not file.is_file():
            raise ValueError(f"{where}: class_name {spec!r}: file {path_str!r} does not exist")
        module = load_user_file(file, "klppo_user_tool")
    else:
        module_path, _, attr = spec.rpartition(".")
        try:
            module = importlib.import_module(module_path) if module_path else None
        except ImportError as error:
            raise ValueError(f"{where}: class_name {spec!r}: {error}") from None
        if module is None:
            known = ", ".join(sorted(BUILTIN_TOOLS))
            raise ValueError(f"{where}: unknown class_name {spec!r} (built in: {known})")
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where}: class_name {spec!r}: no class {attr!r} there")
    return cls
