"""The run's best validation step, and its model kept (HF Trainer's ``load_best_model_at_end``
and ``metric_for_best_model``).

PPO against a learned reward model can over-optimize it: the reward model's score keeps
rising while the policy's real quality peaks and falls (Gao et al., 2022). The loop
therefore tracks one validation metric (``trainer.best_metric``; ``auto``: the task's
choice, :attr:`klppo_train.loop.run_loop.Task.best_metric`) and, at each validation that
improves it, has the task export its model next to the final one (``actor_hf_best``,
``reward_model_hf_best``). The step and value are saved in checkpoints (a resumed run compares
against the same best) and in ``summary.json``; checkpoint pruning keeps the best step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klppo_train.config.errors import UserError
from klppo_train.runtime.process_group import from_main


def greater_is_better(metric: str, configured: bool | None) -> bool:
    """``configured``, else HF's rule: lower is better for a loss, higher for anything else."""
    return configured if configured is not None else "loss" not in metric


@dataclass
class BestStep:
    """The best value of ``metric`` seen at a validation and its step (None: none yet).
    Ties keep the earlier step. Stateful (saved in checkpoints)."""

    metric: str
    greater: bool
    step: int | None = None
    value: float | None = None

    def improves(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` (one validation's, the same on every rank) beat the best;
        if so it becomes the best. Rank 0 decides for all: the export is a collective."""
        if self.metric not in metrics:
            raise UserError(
                f"trainer.best_metric={self.metric!r} is not among this run's validation "
                f"metrics ({', '.join(sorted(metrics)) or 'none'})"
            )
        value = float(metrics[self.metric])
        better = self.value is None or (value > self.value if self.greater else value < self.value)
        if from_main(better):
            self.step, self.value = step, value
            return True
        return False

    def summary(self, export: str) -> dict[str, Any]:
        """``summary.json``'s ``best`` entry (``export``: the best model's folder, once any)."""
        kept = export if self.step is not None else None
        return {"metric": self.metric, "step": self.step, "value": self.value, "export": kept}

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "step": self.step, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric") == self.metric:  # a changed best_metric starts afresh
            self.step, self.value = state["step"], state["value"]
