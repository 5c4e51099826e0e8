"""Preemption: SIGTERM (a scheduler's notice) or a first Ctrl-C ends the run at the next step
boundary, with a checkpoint of the last completed step.

SLURM, Kubernetes and torchrun send SIGTERM, then SIGKILL after a grace period (SLURM: the
partition's ``GraceTime`` or ``--signal``; Kubernetes: ``terminationGracePeriodSeconds``;
torchrun forwards the signal to its workers and waits ``--shutdown-timeout``, 30 s by
default). The handler only records the signal. After every step all ranks agree whether
any of them received one (one host-side all-reduce,
:func:`klppo_train.runtime.process_group.failed_ranks`), so every rank finishes the same
step; the run then checkpoints that step (unless it was just saved) and exits with
:data:`PREEMPTED_EXIT`. ``trainer.resume_mode=auto`` continues from there exactly. A second
signal ends the process at once (the signal's default action).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

from klppo_train.runtime.process_group import failed_ranks

log = logging.getLogger("klppo_train")

PREEMPTED_EXIT = 143
"""The exit code of a preempted run: 128 + SIGTERM, what a shell reports for a process that
SIGTERM ended, and in the retryable range (128-255) of Kubeflow's ``restartPolicy: ExitCode``
and of Kubernetes' ``podFailurePolicy`` rules (``onExitCodes: [143]``)."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at a step boundary on a signal; its checkpoint holds ``step``."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(f"{signal_name}: stopped after step {step}, checkpointed")
        self.step = step


class Preemption:
    """The signal handlers, installed while the ``with`` block runs (the main thread only:
    Python delivers signals there)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second: the default action, now
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received = number
        log.warning(
            "%s: stopping after this step with a checkpoint (send it again to stop now)",
            signal.Signals(number).name,
        )

    def agreed(self) -> bool:
        """Whether any rank received a signal (every rank calls it, at the same point)."""
        return bool(failed_ranks(self.received is not None))

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal on another rank"
