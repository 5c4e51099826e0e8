"""Command line: ``klppo-train [RECIPE.yaml] [key=value ...] [--print-config [--explain]]``."""

from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

# apps/train/recipes/ in a source checkout (the workspace install is editable).
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DISTRIBUTIONS = (
    "klppo-ppo-core",
    "klppo-batching",
    "klppo-fsdp-sharding",
    "klppo-rollout",
    "klppo-train",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="klppo-train",
        description="KL-regularized PPO for LLMs.",
        epilog="Overrides use dotted keys, e.g. actor.ppo_max_token_len_per_gpu=16384.",
    )
    parser.add_argument("recipe", nargs="?", help="YAML recipe (default: the embedded default)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="with --print-config (implied): each key's documentation above it",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' logs and warnings (vLLM, transformers, FSDP)",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a config or data error"
    )
    args = parser.parse_intermixed_args(argv)  # flags anywhere among the overrides
    args.print_config = args.print_config or args.explain
    if args.recipe and "=" in args.recipe:  # no recipe given, only overrides
        args.overrides.insert(0, args.recipe)
        args.recipe = None
    return args


def default_recipe() -> Path | None:
    path = RECIPES / "default.yaml"
    return path if path.is_file() else None


def versions() -> str:
    return ", ".join(f"{d} {version(d)}" for d in DISTRIBUTIONS)
