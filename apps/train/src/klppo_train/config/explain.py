"""``--print-config --explain``: the resolved config with each key's documentation above it.

A key's text is its field's attribute docstring (the string literal after the field, as the
app's sections write them) or its entry in the class docstring's ``Attributes:`` section (as
the packages' configs write them). The output is still YAML: it loads back as a recipe.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import fields, is_dataclass

from klppo_train.config.schema import AppConfig, section_type, to_yaml

KEY_LINE = re.compile(r"^(?P<indent> *)'?(?P<key>[A-Za-z_]\w*)'?:")
WIDTH = 92


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """``{field: text}`` of the string literals that follow the fields in the class body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen or compiled install)
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        literal = after.value if isinstance(after, ast.Expr) else None
        if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
            docs[node.target.id] = " ".join(literal.value.split())
    return docs


def _attributes_section(cls: type) -> dict[str, str]:
    """``{field: text}`` of a Google-style ``Attributes:`` section in the class docstring."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    names = {f.name for f in fields(cls)}
    docs: dict[str, list[str]] = {}
    current = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        entry = re.match(r"^\s{0,8}(\w+): (.*)$", line)
        if entry and entry.group(1) in names:
            current = entry.group(1)
            docs[current] = [entry.group(2)]
        elif current and line.strip():
            docs[current].append(line.strip())
        elif not line.strip() and current:
            current = None
    return {name: " ".join(" ".join(parts).split()) for name, parts in docs.items()}


def field_docs(cls: type) -> dict[str, str]:
    """Every documented field of the dataclass ``cls`` (and of the dataclasses it extends: an
    app section over a package's config); a section without a text of its own gets its class
    docstring's first paragraph."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if is_dataclass(c)]):  # a section's own last
        docs |= {**_attributes_section(base), **_attribute_docstrings(base)}
    for f in fields(cls):
        section = section_type(cls, f.name)
        if f.name not in docs and section is not None and inspect.getdoc(section):
            docs[f.name] = " ".join(inspect.getdoc(section).split("\n\n")[0].split())
    return docs


def explained_yaml(config: AppConfig) -> str:
    """:func:`to_yaml` of ``config`` with each documented key's text as comments above it."""
    out: list[str] = []
    stack: list[tuple[int, type | None]] = [(-1, AppConfig)]
    for line in to_yaml(config).splitlines():
        match = KEY_LINE.match(line)
        if not match:
            out.append(line)
            continue
        indent, key = len(match.group("indent")), match.group("key")
        while stack[-1][0] >= indent:
            stack.pop()
        owner = stack[-1][1]
        text = field_docs(owner).get(key) if owner is not None else None
        if text:
            prefix = " " * indent + "# "
            out += textwrap.wrap(text, WIDTH, initial_indent=prefix, subsequent_indent=prefix)
        valid = owner is not None and is_dataclass(owner) and key in {f.name for f in fields(owner)}
        stack.append((indent, section_type(owner, key) if valid else None))
        out.append(line)
    return "\n".join(out) + "\n"
