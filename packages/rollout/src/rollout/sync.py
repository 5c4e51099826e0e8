"""Trainer → engine weight sync, and the train/rollout log-prob mismatch probe."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from rollout.protocol import RolloutEngine


class WeightSync:
    """Push the trainer's current weights into a rollout engine.

    Ordering rules:
        1. Call :meth:`sync` after the optimizer step of an update and before the next
           ``generate``: samples are stamped with the version the engine holds, so a
           generate between the step and the sync is (correctly) stamped with the old one.
        2. Every trainer rank calls :meth:`sync`: the iterator (e.g.
           ``fsdp_sharding.iter_full_state_dict``) runs one collective per tensor, and all
           ranks must walk it to the end in the same order.
        3. Only the engine's owner loads: pass ``engine=None`` on ranks that host no
           engine; they still drain the iterator.
        4. Versions increase: ``sync(version)`` with a version not above the last one raises.
        5. With ``dtype``, each floating-point tensor is cast as it streams (one tensor at a
           time, never a second copy of the model): fp32 master weights reach a bf16 engine
           at half the bytes.

    Args:
        named_tensors: returns a fresh ``(hf_name, tensor)`` iterator each time it is called.
        engine: the engine this rank feeds, or ``None``.
        dtype: the engine's weight dtype; ``None`` sends tensors as they come.
    """

    def __init__(
        self,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        engine: RolloutEngine | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.named_tensors = named_tensors
        self.engine = engine
        self.dtype = dtype
        self.version = engine.policy_version if engine is not None else 0
        self.metrics: dict[str, float] = {}

    def sync(self, version: int) -> dict[str, float]:
        """Stream the weights into the engine; return ``timing_s/update_weights`` and bytes."""
        if version <= self.version:
            raise ValueError(
                f"WeightSync.sync(version={version}): must exceed the last version {self.version}"
            )
        moved = {"bytes": 0}

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.named_tensors():
                if self.dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(self.dtype)
                moved["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        if self.engine is not None:
            self.engine.update_weights(counted(), version=version)
        else:
            for _ in counted():  # take part in every collective, keep nothing
                pass
        self.version = version
        self.metrics = {
            "timing_s/update_weights": time.perf_counter() - start,
            "rollout/weight_sync_bytes": float(moved["bytes"]),
        }
        return self.metrics


def logprob_mismatch(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's sampling log-probs are from the trainer's, over valid tokens.

    Args:
        engine_logprobs: ``[B, T]`` log-probs the engine reported for the sampled tokens.
        trainer_logprobs: ``[B, T]`` the trainer's log-probs of the same tokens, same weights.
        mask: ``[B, T]`` response mask.

    Returns:
        ``rollout/logprob_diff_mean``, ``rollout/logprob_diff_max`` (absolute differences) and
        ``rollout/logprob_k3_kl`` (k3 estimate of KL(engine ‖ trainer)), detached tensors.
    """
    if not engine_logprobs.shape == trainer_logprobs.shape == mask.shape:
        raise ValueError(
            f"shapes differ: engine_logprobs {tuple(engine_logprobs.shape)}, trainer_logprobs "
            f"{tuple(trainer_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.to(torch.float32)
    count = m.sum().clamp(min=1)
    diff = (engine_logprobs.float() - trainer_logprobs.float()).detach()
    log_ratio = (-diff).clamp(-20, 20)  # log(p_trainer / p_engine) on engine samples
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "rollout/logprob_diff_mean": (diff.abs() * m).sum() / count,
        "rollout/logprob_diff_max": (diff.abs() * m).max(),
        "rollout/logprob_k3_kl": (k3 * m).sum() / count,
    }
