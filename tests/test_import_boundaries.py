"""Layer rules of DEVELOPERS.md, checked by scanning every ``src/`` file's imports (AST).

Every import counts, including the ones inside functions, so a lazy import of a
forbidden package is still caught; only ``vllm`` is allowed lazily, in ``rollout``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

# module -> third-party/internal top-level modules it may import (besides stdlib and itself)
ALLOWED = {
    "ppo_core": {"torch"},
    "batching": {"torch", "numpy"},
    "fsdp_sharding": {"torch"},
    "rollout": {"torch", "transformers", "vllm", "safetensors"},
    "klppo_train": {
        "omegaconf",
        "pyarrow",
        "yaml",  # pyyaml: recipe syntax errors
        "tokenizers",
        "tqdm",
        "matplotlib",
        "wandb",  # optional trackers (trainer.logger), imported only when chosen
        "mlflow",
        "peft",  # optional: model.lora_rank > 0
        "torch",
        "numpy",
        "transformers",
        "vllm",
        "ppo_core",
        "batching",
        "fsdp_sharding",
        "rollout",
    },
}
SRC_DIRS = {
    "ppo_core": ROOT / "packages/ppo_core/src/ppo_core",
    "batching": ROOT / "packages/batching/src/batching",
    "fsdp_sharding": ROOT / "packages/fsdp_sharding/src/fsdp_sharding",
    "rollout": ROOT / "packages/rollout/src/rollout",
    "klppo_train": ROOT / "apps/train/src/klppo_train",
}
LAZY_ONLY = {"vllm"}


def imports_of(source: str) -> list[tuple[str, int, bool]]:
    """``(top-level module, line, runs at import time)`` for every absolute import."""
    tree = ast.parse(source)
    import_time = {id(n) for n in _walk_import_time(tree)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], node.lineno, id(node) in import_time) for name in names]
    return found


def _walk_import_time(node: ast.AST):
    """Nodes executed when the module is imported: everything outside function bodies
    (module-level if/try/with and class bodies included)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield child
        yield from _walk_import_time(child)


def violations(module: str, source: str, filename: str) -> list[str]:
    problems = []
    for name, line, at_top in imports_of(source):
        if name in STDLIB or name == module:
            continue
        if name == "klppo_train" and module != "klppo_train":
            problems.append(
                f"{filename}:{line}: imports klppo_train (packages never import the app)"
            )
        elif name not in ALLOWED[module]:
            problems.append(f"{filename}:{line}: {module} may not import {name!r}")
        elif name in LAZY_ONLY and at_top:
            problems.append(
                f"{filename}:{line}: imports {name!r} at module top level (must be lazy)"
            )
    return problems


@pytest.mark.parametrize("module", sorted(SRC_DIRS))
def test_package_respects_its_layer(module: str) -> None:
    files = sorted(SRC_DIRS[module].rglob("*.py"))
    assert files, f"no source files found for {module}"
    problems = [
        p for f in files for p in violations(module, f.read_text(), str(f.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("ppo_core", "import numpy as np\n", "may not import 'numpy'"),
        ("ppo_core", "def f():\n    import transformers\n", "may not import 'transformers'"),
        ("batching", "from klppo_train.config.schema import X\n", "imports klppo_train"),
        ("rollout", "import vllm\n", "at module top level"),
        (
            "rollout",
            "try:\n    from vllm import LLM\nexcept ImportError:\n    pass\n",
            "at module top level",
        ),
        ("rollout", "class E:\n    def start(self):\n        import vllm\n", None),
        ("ppo_core", "import torch, math\nfrom ppo_core.masked import masked_mean\n", None),
    ],
)
def test_checker_catches_violations(module: str, source: str, expected: str | None) -> None:
    problems = violations(module, source, "x.py")
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_demo_is_a_leaf_that_core_modules_do_not_import() -> None:
    """Only the command line (``__main__``) and the demos themselves import
    ``klppo_train.demo``; the rest of the app reaches the demos through the sources they
    register (``klppo_train.data.sources``)."""
    app = SRC_DIRS["klppo_train"]
    offenders = []
    for path in sorted(app.rglob("*.py")):
        relative = path.relative_to(app)
        if relative.parts[0] == "demo" or relative.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module]
            if any(n and n.startswith("klppo_train.demo") for n in names):
                offenders.append(f"{relative}:{node.lineno}")
    assert not offenders, f"core modules import the demos: {offenders}"
