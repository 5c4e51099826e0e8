"""Orders and weights among several generating ranks (``async_training.rollout_ranks`` > 1).

Only the first generating rank talks to training rank 0 over the link; it relays what it
takes to the others over the generating side's own default group (collectives), so every
generating rank follows the same orders and generates with the same version. Ordering
rules: every generating rank calls :func:`next_order` and :func:`take_weights` at the same
points; a version's tensors are relayed one at a time, as the first rank's engine takes
them from the link, then a sentinel ends the version. With one generating rank these are
the plain link calls. The first order (``start`` or ``stop``) is not relayed: training rank 0
sends it to each generating rank, which waits for it without the link's timeout (a relay's
collective would time out while the training ranks build).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_sharding import default_device
from klppo_train.runtime.process_group import RolloutLink
from rollout import receive_weights, recv_object


def _shared(obj: Any) -> Any:
    """``obj`` of the first generating rank, on every one of them."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def next_order(link: RolloutLink) -> tuple:
    """The next order of training rank 0 (the first generating rank receives it)."""
    if dist.get_world_size() == 1:
        return recv_object(link.group, link.peer)
    return _shared(recv_object(link.group, link.peer) if dist.get_rank() == 0 else None)


def take_weights(link: RolloutLink, engine: Any) -> int:
    """Load the next version into ``engine`` on every generating rank; the version."""
    if dist.get_world_size() == 1:
        return receive_weights(link.group, link.peer, engine)
    if dist.get_rank() == 0:
        return receive_weights(link.group, link.peer, _Relay(engine))
    version = _shared(None)
    engine.update_weights(_relayed(), version=version)
    return version


class _Relay:
    """The first generating rank's engine, relaying each tensor as it loads it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        _shared(version)
        self.engine.update_weights(_relaying(named), version=version)


def _relaying(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        _shared((name, tuple(tensor.shape), tensor.dtype))
        dist.broadcast(tensor.to(default_device()), src=0)
        yield name, tensor
    _shared(None)  # the version is whole


def _relayed() -> Iterator[tuple[str, torch.Tensor]]:
    while (header := _shared(None)) is not None:
        name, shape, dtype = header
        tensor = torch.empty(shape, dtype=dtype, device=default_device())
        dist.broadcast(tensor, src=0)
        yield name, tensor
