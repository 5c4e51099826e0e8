"""Test hook: out-of-memory errors on demand, to test the OOM back-off on CPU.

``KLPPO_FAULT_OOM="<step>:<pass>:<micro_batch>[@<rank>][,...]"`` raises
``torch.OutOfMemoryError`` from inside the real pass (after that micro-batch's model forward,
where the logits' allocation fails first on a real device), once per entry, on every rank
or only on ``rank``. ``pass`` is one of :data:`PASSES`; ``step`` counts from 1 like the
run's steps; ``micro_batch`` is 0-based and counts every micro-batch the pass starts in
that step, redone ones included (an update's micro-batches over all its mini-batches and
epochs). Unset or empty: nothing happens (on CPU a real OOM kills the process instead of
raising).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from klppo_train.config.roles import PASS_ROLES

ENV = "KLPPO_FAULT_OOM"
PASSES = tuple(PASS_ROLES)


def parse_faults(spec: str) -> dict[tuple[int, str, int], int | None]:
    """``{(step, pass, micro_batch): rank or None (every rank)}`` of ``spec``; ``ValueError``
    naming the variable."""
    faults: dict[tuple[int, str, int], int | None] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        where, at, rank = entry.partition("@")
        parts = where.split(":")
        ok = len(parts) == 3 and parts[1] in PASSES and all(p.isdigit() for p in parts[::2])
        if not ok or (at and not rank.isdigit()):
            raise ValueError(
                f"{ENV}={spec!r}: {entry!r} is not <step>:<pass>:<micro_batch>[@<rank>] "
                f"with pass one of {', '.join(PASSES)}"
            )
        faults[(int(parts[0]), parts[1], int(parts[2]))] = int(rank) if rank else None
    return faults


class OOMFaults:
    """The pending faults and the pass that is running (set by the back-off loop)."""

    def __init__(self, spec: str = "") -> None:
        self.reset(spec)

    def reset(self, spec: str) -> None:
        """Start over with the faults of ``spec`` (checked: ``ValueError``)."""
        self.pending = parse_faults(spec)
        self.raised = 0
        self._where: tuple[int, str] | None = None
        self._started: dict[tuple[int, str], int] = {}

    def reset_from_env(self) -> None:
        self.reset(os.environ.get(ENV, ""))

    @contextmanager
    def in_pass(self, step: int, pass_name: str) -> Iterator[None]:
        outer, self._where = self._where, (step, pass_name)
        try:
            yield
        finally:
            self._where = outer

    def micro_batch(self) -> None:
        """Called after each micro-batch's model forward; raises when one is due here."""
        if not self.pending or self._where is None:
            return
        index = self._started.get(self._where, 0)
        self._started[self._where] = index + 1
        fault = (*self._where, index)
        if fault not in self.pending:
            return
        rank = self.pending.pop(fault)  # gone on every rank: their counts stay the same
        if rank is None or rank == int(os.environ.get("RANK", "0")):
            self.raised += 1
            import torch  # not at the top: the checks that read the variable run without it

            raise torch.OutOfMemoryError(f"injected by {ENV} at {fault[0]}:{fault[1]}:{index}")


# Loaded from the environment by the run's checks (klppo_train.checks.preflight), once per run.
FAULTS = OOMFaults()
