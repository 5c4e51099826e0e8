"""Public-API snapshots of the klppo distributions: ``tests/api/<distribution>.json``.

    ./uvw run python scripts/api_snapshot.py                  # regenerate every snapshot
    ./uvw run python scripts/api_snapshot.py klppo-ppo-core   # regenerate one

A snapshot records the version in the distribution's ``pyproject.toml`` and, for each public
name (the package's ``_EXPORTS``, which its ``__all__`` lists), its kind and signature: a
function's ``inspect.signature``, a class's constructor, public methods and dataclass fields,
a constant's value. The app ``klppo-train`` has no importable API: its snapshot holds its
command-line entry points. ``tests/test_api_snapshot.py`` fails when the current API differs
from the snapshot of the same version, or when the version moved and the snapshot did not:
a release bumps the version and regenerates the snapshot in the same change
(docs/releasing.md). The text is that of the locked Python and torch (annotations, type
aliases). Where an upgrade of those alone changes it, regenerate without a bump.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import tomllib
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT_DIR = ROOT / "tests" / "api"
# distribution → (its folder, its import name)
DISTRIBUTIONS = {
    "klppo-ppo-core": ("packages/ppo_core", "ppo_core"),
    "klppo-batching": ("packages/batching", "batching"),
    "klppo-fsdp-sharding": ("packages/fsdp_sharding", "fsdp_sharding"),
    "klppo-rollout": ("packages/rollout", "rollout"),
    "klppo-train": ("apps/train", "klppo_train"),
}
REGENERATE = "./uvw run python scripts/api_snapshot.py"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
# dunders that are part of a class's public behaviour (all other "_" names are not)
_PUBLIC_DUNDERS = ("__call__", "__enter__", "__exit__", "__iter__", "__len__")


def pyproject(dist: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / DISTRIBUTIONS[dist][0] / "pyproject.toml").read_text())


def version_of(dist: str) -> str:
    """The version in the distribution's pyproject.toml (not the installed metadata, which
    an editable install only updates on the next sync)."""
    return pyproject(dist)["project"]["version"]


def snapshot_path(dist: str) -> Path:
    return SNAPSHOT_DIR / f"{dist}.json"


class _Text:
    """Shows as the given text in a signature (no quotes, no memory address)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _is_simple(value: Any) -> bool:
    if isinstance(value, _SIMPLE):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_is_simple(v) for v in value)
    if isinstance(value, dict):
        return all(_is_simple(k) and _is_simple(v) for k, v in value.items())
    return False


def value_text(value: Any) -> str:
    """A default or constant as stable text: repr of simple values (sets sorted), an enum
    member by name, anything else by its repr without memory addresses."""
    if isinstance(value, (set, frozenset)) and _is_simple(value):
        items = ", ".join(sorted(repr(v) for v in value))
        return f"{type(value).__name__}({{{items}}})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    return _ADDRESS.sub("", repr(value))


def annotation_text(annotation: Any) -> str:
    if isinstance(annotation, str):  # `from __future__ import annotations`: the source text
        return annotation
    return _ADDRESS.sub("", inspect.formatannotation(annotation))


def signature_text(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(?)"
    params = []
    for p in sig.parameters.values():
        changes: dict[str, Any] = {}
        if p.default is not p.empty:
            changes["default"] = _Text(value_text(p.default))
        if p.annotation is not p.empty:
            changes["annotation"] = _Text(annotation_text(p.annotation))
        params.append(p.replace(**changes))
    ret = sig.return_annotation
    ret = ret if ret is sig.empty else _Text(annotation_text(ret))
    return str(sig.replace(parameters=params, return_annotation=ret))


def _member(obj: Any) -> str:
    if isinstance(obj, staticmethod):
        return f"staticmethod {signature_text(obj.__func__)}"
    if isinstance(obj, classmethod):
        return f"classmethod {signature_text(obj.__func__)}"
    if isinstance(obj, property):
        return "property" + ("" if obj.fset is None else " (settable)")
    if callable(obj):
        return signature_text(obj)
    return f"attribute {value_text(obj) if _is_simple(obj) else type(obj).__name__}"


def describe_class(cls: type, top: str) -> dict[str, Any]:
    if issubclass(cls, enum.Enum):
        return {"kind": "enum", "members": {m.name: value_text(m.value) for m in cls}}
    fields = {}
    if dataclasses.is_dataclass(cls):
        fields = {f.name: annotation_text(f.type) for f in dataclasses.fields(cls)}
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):  # NamedTuple
        hints = getattr(cls, "__annotations__", {})
        fields = {f: annotation_text(hints.get(f, "")) for f in cls._fields}
    methods = {}
    # the package's own classes in the MRO: no torch.nn.Module / Protocol / object members
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] != top:
            continue
        for name, attr in vars(klass).items():
            if name in fields or (name.startswith("_") and name not in _PUBLIC_DUNDERS):
                continue
            methods[name] = _member(attr)
    entry: dict[str, Any] = {}
    if getattr(cls, "_is_protocol", False):
        entry["kind"] = "protocol"
    else:
        entry["kind"] = "dataclass" if dataclasses.is_dataclass(cls) else "class"
        entry["signature"] = signature_text(cls)
    if dataclasses.is_dataclass(cls):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        entry["frozen"] = params.frozen
    if fields:
        entry["fields"] = fields
    if methods:
        entry["methods"] = dict(sorted(methods.items()))
    return entry


def describe(obj: Any, top: str) -> dict[str, Any]:
    """One public name's kind and signature."""
    if inspect.isclass(obj):
        return describe_class(obj, top)
    if typing.get_origin(obj) is not None or isinstance(obj, typing.TypeVar):
        return {"kind": "type alias", "value": annotation_text(obj)}
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return {"kind": "function", "signature": signature_text(obj)}
    if callable(obj):
        return {"kind": f"callable {type(obj).__name__}", "signature": signature_text(obj)}
    entry = {"kind": "constant", "type": type(obj).__name__}
    if _is_simple(obj):
        entry["value"] = value_text(obj)
    return entry


def public_names(module: Any) -> list[str]:
    names = getattr(module, "_EXPORTS", None) or getattr(module, "__all__", None)
    if names is None:
        raise SystemExit(f"{module.__name__}: neither _EXPORTS nor __all__")
    return sorted(names)


def entry_points(dist: str) -> dict[str, Any]:
    """An app's API: its command-line entry points and the functions they call."""
    out = {}
    for script, target in sorted(pyproject(dist)["project"].get("scripts", {}).items()):
        module_name, _, attr = target.partition(":")
        func = getattr(importlib.import_module(module_name), attr)
        out[script] = {
            "kind": "console script",
            "target": target,
            "signature": signature_text(func),
        }
    return out


def current(dist: str) -> dict[str, Any]:
    """The distribution's snapshot as it is now."""
    top = DISTRIBUTIONS[dist][1]
    module = importlib.import_module(top)
    if hasattr(module, "_EXPORTS") or hasattr(module, "__all__"):
        api = {name: describe(getattr(module, name), top) for name in public_names(module)}
    else:
        api = entry_points(dist)
    return {"distribution": dist, "module": top, "version": version_of(dist), "api": api}


def dumps(snapshot: dict[str, Any]) -> str:
    return json.dumps(snapshot, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(dist: str) -> Path:
    path = snapshot_path(dist)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(current(dist)))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is not a checked-in file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """What changed between two snapshots' ``api`` maps, one line per change."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{where}.{key}" if where else key
            if key not in new:
                out.append(f"removed {path}: {json.dumps(old[key], ensure_ascii=False)}")
            elif key not in old:
                out.append(f"added {path}: {json.dumps(new[key], ensure_ascii=False)}")
            else:
                out.extend(differences(old[key], new[key], path))
        return out
    if old != new:
        return [f"changed {where}: {old!r} -> {new!r}"]
    return []


def main(argv: list[str]) -> int:
    unknown = [d for d in argv if d not in DISTRIBUTIONS]
    if unknown:
        print(f"unknown distribution(s) {unknown}; known: {sorted(DISTRIBUTIONS)}")
        return 2
    for dist in argv or DISTRIBUTIONS:
        path = write(dist)
        print(f"{dist} {version_of(dist)}: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
