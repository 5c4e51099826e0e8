"""The narrow boundary between the trainer and any generation engine.

The trainer imports only this Protocol and the value types; it never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from rollout.config import SamplingConfig
from rollout.types import RolloutBatch


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine the PPO loop can drive.

    Contract:
        - ``generate`` returns samples grouped by prompt (prompt i's ``n`` samples are
          contiguous, in prompt order), each stamped with ``policy_version``.
        - ``update_weights`` replaces the weights named in ``named_tensors`` (HF names) and
          sets ``policy_version = version``; every later ``generate`` uses the new weights.
        - ``sleep``/``wake_up`` free and restore accelerator memory between rollouts where
          the engine supports it, and are explicit no-ops elsewhere.
    """

    policy_version: int

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """Samples for every prompt (``sampling.n`` each).

        ``max_new_tokens``: one cap per prompt, instead of ``sampling.max_new_tokens`` (a
        multi-turn rollout's conversations have spent different parts of their budget).

        ``seeds``: one per prompt, instead of ``sampling.seed`` for the whole call. Both
        engines give each prompt its own seeded stream, so a prompt's samples do not depend
        on what else is in the call (which rank it landed on).
        """
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightPublisher(Protocol):
    """What carries the trainer's weights to the generating side: :class:`rollout.WeightSync`
    (every weight) and :class:`rollout.AdapterSync` (LoRA adapters, merged on arrival).

    Contract:
        - ``version`` is the last version published (the engine's at construction).
        - ``sync(version)`` publishes the trainer's current weights as ``version``, which
          must exceed the last one; every trainer rank calls it (the weights are gathered
          with collectives); it returns ``rollout/weight_sync_bytes`` and
          ``timing_s/update_weights``.
    """

    version: int

    def sync(self, version: int) -> dict[str, float]: ...
