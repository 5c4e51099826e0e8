"""Entry point of `uv run apps/train`, `python -m klppo_train` and the `klppo-train` script."""

from __future__ import annotations

import json
import logging
import sys

from klppo_train.cli import default_recipe, parse_args, versions
from klppo_train.config import load_config, to_yaml
from klppo_train.run import train
from klppo_train.validate import validate_config

log = logging.getLogger("klppo_train")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        config = load_config(args.recipe or default_recipe(), args.overrides)
        advice = validate_config(config)
    except ValueError as err:
        print(f"klppo-train: config error: {err}", file=sys.stderr)
        return 2
    for line in advice:
        log.info("token budgets: %s", line)
    print(versions())
    if args.print_config:
        print(to_yaml(config))
        return 0
    summary = train(config)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
