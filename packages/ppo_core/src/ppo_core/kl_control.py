"""KL coefficient controllers (Ziegler et al., 2019, "Fine-Tuning Language Models from Human
Preferences", section 2.2).

The controller runs once per PPO step on the host; it is bookkeeping, not tensor math,
so it takes Python floats (a 0-d tensor is read once with ``float``).
"""

from __future__ import annotations

from typing import Any

import torch


def _as_float(name: str, value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"`{name}` must be a scalar, got shape {tuple(value.shape)}")
        return float(value.detach())
    return float(value)


class FixedKLController:
    """A constant β. ``update`` does nothing; it exists so both controllers are interchangeable.

    Args:
        kl_coef: β ≥ 0.
    """

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"`kl_coef` must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target_kl``.

    e = clip(KL / KL_target − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).

    ``n_steps`` is the number of samples (sequences) collected since the last update —
    the batch size of the PPO step in Ziegler et al. — so ``horizon`` is measured in
    samples: β moves by at most 20 % per ``horizon`` samples.

    Args:
        init_kl_coef: initial β > 0.
        target_kl: KL_target > 0, in the units of ``apply_kl_penalty``'s ``metrics["kl"]``.
        horizon: > 0, samples over which a 20 % error changes β by 20 %.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        for name, value in (
            ("init_kl_coef", init_kl_coef),
            ("target_kl", target_kl),
            ("horizon", horizon),
        ):
            if not value > 0:
                raise ValueError(f"`{name}` must be > 0, got {value}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move β after a step that collected ``n_steps`` samples with mean KL ``current_kl``.

        Raises:
            ValueError: ``n_steps`` < 0, or ``n_steps / horizon`` ≥ 5 (the factor
                1 − 0.2·n/h would reach 0 and β could stop being positive).
        """
        if n_steps < 0 or n_steps >= 5 * self.horizon:
            raise ValueError(
                f"`n_steps` must be in [0, 5 * horizon) = [0, {5 * self.horizon:g}), got {n_steps}"
            )
        kl = _as_float("current_kl", current_kl)
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = float(state["horizon"])
