"""The run's per-device token budgets: resolved once, halved on out-of-memory, checkpointed.

One budget per role of :data:`klppo_train.config.roles.ROLES` (its key takes a number or
``auto``, measured before step 0 by :mod:`klppo_train.trainer.probe`); each pass runs within its
role's budget (:data:`klppo_train.config.roles.PASS_ROLES`).

OOM back-off (:func:`run_with_backoff`): a ``torch.OutOfMemoryError`` inside a pass frees
what it can, halves that role's budget (never below one longest sequence, the rule's
minimum), re-plans the same batch and runs the pass again from its start. Losses are exact
global token-means, so the result is what the smaller budget would have given from the
start, up to float summation order. The new budget stays for the rest of the run and goes
into ``run_dir/budgets.json`` and the checkpoints.

Under torchrun the back-off is exact when every rank raises at the same point (the fault
hook, :mod:`klppo_train.budgets.faults`, does); a real OOM on one rank alone leaves the others
waiting in a collective, which this cannot mend.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from klppo_train.budgets.faults import FAULTS
from klppo_train.config.roles import (
    AUTO,
    PASS_ROLES,
    ROLES,
    config_value,
    longest_sequence,
    run_roles,
)

log = logging.getLogger("klppo_train")
T = TypeVar("T")

BUDGETS_FILE = "budgets.json"  # in the run directory


def configured(cfg: Any, role: str) -> int | str:
    """The role's budget as the config gives it: a number or ``"auto"``."""
    return config_value(cfg, ROLES[role].budget_key)


@dataclass
class Backoff:
    """One halving: where it happened and what the budget became."""

    step: int
    pass_name: str
    role: str
    old: int
    new: int
    error: str


@dataclass
class RunBudgets:
    """The budgets in force, per role (``tokens``), and how they came to be.

    ``source`` says per role ``"config"``, ``"auto"`` (probed) or ``"checkpoint"``;
    ``probe`` holds what the probe measured and fitted (None when nothing was probed).
    """

    tokens: dict[str, int]
    minimum: int
    source: dict[str, str] = field(default_factory=dict)
    probe: dict[str, Any] | None = None
    backoffs: list[Backoff] = field(default_factory=list)
    path: Path | None = None  # budgets.json, written by rank 0 (None: not written)

    def __getitem__(self, role: str) -> int:
        return self.tokens[role]

    @property
    def oom_retries(self) -> int:
        """Passes redone after an out-of-memory error, over the whole run."""
        return len(self.backoffs)

    def back_off(self, pass_name: str, step: int, error: str) -> int:
        """Halve the budget of ``pass_name``'s role; return it. Raises ``torch.OutOfMemoryError``
        naming the key when the budget is at the minimum already."""
        role = PASS_ROLES[pass_name]
        key = ROLES[role].budget_key
        old = self.tokens[role]
        if old <= self.minimum:
            raise torch.OutOfMemoryError(
                f"{pass_name} (step {step}) is out of memory at {key}={old}, the "
                f"minimum (one sequence of max_prompt_length + response_length = "
                f"{self.minimum} tokens): shorten data.max_prompt_length or "
                f"rollout.response_length, turn on gradient checkpointing or offloading, or "
                f"use more devices. The error: {error}"
            )
        new = max(old // 2, self.minimum)
        self.tokens[role] = new
        self.backoffs.append(Backoff(step, pass_name, role, old, new, error[:300]))
        log.warning(
            "out of memory in %s (step %d): %s %d -> %d, pass redone", pass_name, step,
            key, old, new,
        )  # fmt: skip
        self.write()
        return new

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state.pop("path")
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], path: Path | None = None) -> RunBudgets:
        """What :meth:`state_dict` saved (a checkpoint's), as now in force."""
        return cls(
            tokens=dict(state["tokens"]),
            minimum=int(state["minimum"]),
            source={role: "checkpoint" for role in state["tokens"]},
            probe=state.get("probe"),
            backoffs=[Backoff(**b) for b in state.get("backoffs", [])],
            path=path,
        )

    def write(self) -> None:
        """``budgets.json`` (temporary file, then rename: never half-written)."""
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state_dict(), indent=2))
        os.replace(tmp, self.path)

    def metrics(self) -> dict[str, float]:
        return {f"perf/token_budget/{role}": float(n) for role, n in self.tokens.items()}


def budgets_from_config(
    cfg: Any, path: Path | None = None, probed: dict[str, tuple[int, str]] | None = None
) -> RunBudgets:
    """The config's budgets (:func:`resolve_budgets` of each role's key)."""
    values = {role: configured(cfg, role) for role in run_roles(cfg)}
    return resolve_budgets(values, longest_sequence(cfg), path, probed)


def resolve_budgets(
    values: dict[str, int | str],
    minimum: int,
    path: Path | None = None,
    probed: dict[str, tuple[int, str]] | None = None,
) -> RunBudgets:
    """Each role's configured value (``values``) as a number; ``auto`` ones from ``probed``
    (``{role: (tokens, source)}``, :func:`klppo_train.trainer.probe.choose_budgets`), which
    each must have. ``minimum``: one sequence of full length."""
    tokens = dict(values)
    source = {role: "config" for role in tokens}
    for role, (chosen, how) in (probed or {}).items():
        tokens[role], source[role] = chosen, how
    auto = [ROLES[role].budget_key for role, value in tokens.items() if value == AUTO]
    if auto:
        raise ValueError(
            f"{', '.join(auto)}=auto: chosen by klppo_train.trainer.probe.choose_budgets"
        )
    return RunBudgets(tokens, minimum, source, path=path)


def release_memory() -> None:
    """Give back what an interrupted pass left: Python garbage, the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_with_backoff(
    budgets: RunBudgets,
    pass_name: str,
    step: int,
    run: Callable[[int], T],
    *,
    dynamic: bool = True,
    reset: Callable[[], None] | None = None,
) -> T:
    """``run(budget)`` for ``pass_name``; on ``torch.OutOfMemoryError``: release memory,
    ``reset()`` (an update zeroes its gradients, so the optimizer sees one step), halve the
    budget and run again. ``dynamic=False`` (fixed micro-batch sizes: no budget to lower)
    lets the error through. Each retry is one count of ``budgets.oom_retries``."""
    while True:
        with FAULTS.in_pass(step, pass_name):
            try:
                return run(budgets[PASS_ROLES[pass_name]])
            except torch.OutOfMemoryError as err:
                if not dynamic:
                    raise
                error = str(err).splitlines()[0] if str(err) else "out of memory"
        # Outside the except block: its traceback (and the activations its frames hold)
        # is gone before memory is released and the pass runs again.
        release_memory()
        if reset is not None:
            reset()
        budgets.back_off(pass_name, step, error)
