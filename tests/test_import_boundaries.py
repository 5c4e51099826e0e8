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
    "rollout": {"torch", "transformers", "vllm", "safetensors", "jsonschema"},
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


# The app's folders, bottom first: each imports only folders before it in this list (and
# itself). The entry modules (``__main__``, ``cli``, ``console``) sit above them all and are
# imported by nobody; ``demo`` is a leaf only they import.
APP_LAYERS = (
    "config",  # torch-free: the sections, verl's names, the role table
    "data",
    "agents",  # multi-turn: the tool-config file, the samplers (single-turn or with tools)
    "runtime",
    "tracking",
    "budgets",
    "loop",  # the one run loop, checkpoints, preemption, report
    "workers",  # trajectories, forward passes, trainees
    "reward_model",
    "ppo",
    "checks",
    "trainer",  # the tasks and their building
    "demo",
)
ENTRY = ("__main__", "cli", "console")


def app_imports(app: Path) -> dict[tuple[str, str], list[str]]:
    """``(folder, imported folder) -> [file:line, ...]`` over the app's own imports (a
    top-level module counts as a folder of its own name)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(app.rglob("*.py")):
        relative = path.relative_to(app)
        here = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "klppo_train":
                    names = [f"klppo_train.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "klppo_train" and len(parts) > 1 and parts[1] != here:
                    found.setdefault((here, parts[1]), []).append(f"{relative}:{node.lineno}")
    return found


def layer_violations(found: dict[tuple[str, str], list[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(APP_LAYERS)}
    problems = []
    for (here, there), where in sorted(found.items()):
        if here in ENTRY:
            continue
        if there in ENTRY:
            problems.append(f"{here} imports the entry module {there} ({where[0]})")
        elif here not in rank or there not in rank:
            problems.append(f"{here} -> {there}: a folder missing from APP_LAYERS ({where[0]})")
        elif rank[there] > rank[here]:
            problems.append(f"{here} imports {there}, a folder above it ({', '.join(where)})")
    return problems


def test_app_folders_are_layered() -> None:
    """No folder imports a folder above it (so the folders form no import cycle)."""
    app = SRC_DIRS["klppo_train"]
    found = app_imports(app)
    folders = {p.name for p in app.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(APP_LAYERS), (
        f"APP_LAYERS lists {sorted(APP_LAYERS)}, not {sorted(folders)}"
    )
    problems = layer_violations(found)
    assert not problems, "\n".join(problems)


def test_layer_check_catches_an_upward_import() -> None:
    found = {("ppo", "trainer"): ["ppo/step.py:3"], ("config", "cli"): ["config/x.py:1"]}
    problems = layer_violations(found)
    assert problems == [
        "config imports the entry module cli (config/x.py:1)",
        "ppo imports trainer, a folder above it (ppo/step.py:3)",
    ]


# Functions that take the whole config (an ``AppConfig``, or ``cfg`` typed ``Any``/untyped):
# the config is read once, in the builders; this number may only go down.
WHOLE_CONFIG_PARAMETERS = 66


def whole_config_parameters(app: Path) -> list[str]:
    found = []
    for path in sorted(app.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                    note = ast.unparse(arg.annotation) if arg.annotation else ""
                    if note.endswith("AppConfig") or (arg.arg == "cfg" and note in ("Any", "")):
                        found.append(f"{path.relative_to(app)}:{node.lineno} {node.name}")
    return found


def test_whole_config_parameters_do_not_creep_back() -> None:
    found = whole_config_parameters(SRC_DIRS["klppo_train"])
    assert len(found) <= WHOLE_CONFIG_PARAMETERS, (
        f"{len(found)} functions take the whole config (held at {WHOLE_CONFIG_PARAMETERS}): "
        "read the keys once in a builder and pass objects\n" + "\n".join(found)
    )
