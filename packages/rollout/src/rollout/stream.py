"""Weights and objects between ranks that do not share a process group's role: the training
ranks and a generating rank (``async_training.rollout_ranks``), over a gloo process group
that joins them (``torch.distributed.ProcessGroupGloo`` on the rendezvous store).

Messages are point-to-point ``send``/``recv`` with a tag per kind: a send returns at once
(gloo's background thread moves the bytes once the peer posts its receive), a receive
blocks. So a side never waits for its peer to *take* what it gives, only for what it needs,
and two sides that each send before they receive cannot deadlock.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

WEIGHTS_TAG = 11  # a version's header and tensors
OBJECT_TAG = 12  # send_object / recv_object (the default)
WATCH_TAG = 14  # PeerWatch's one message: the peer ended on purpose


def _send_bytes(group: Any, dst: int, payload: bytes, tag: int) -> list[Any]:
    """Two sends (length, bytes); returns their works, whose buffers they keep alive."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [group.send([size], dst, tag), group.send([data], dst, tag), size, data]


def _recv_bytes(group: Any, src: int, tag: int, timeout: timedelta | None = None) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, tag).wait(timeout or timedelta(0))  # 0: the group's own timeout
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], src, tag).wait(timeout or timedelta(0))
    return data.numpy().tobytes()


def send_object(group: Any, dst: int, obj: Any, tag: int = OBJECT_TAG) -> list[Any]:
    """Send a picklable ``obj`` (tensors included) to rank ``dst`` of ``group``; returns at
    once. Keep the returned list until :func:`wait_all` (it holds the buffers in flight)."""
    return _send_bytes(group, dst, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), tag)


def recv_object(
    group: Any, src: int, tag: int = OBJECT_TAG, timeout: timedelta | None = None
) -> Any:
    """The next object rank ``src`` of ``group`` sent with ``tag`` (blocks; waiting longer
    than ``timeout``, by default ``group``'s, raises ``RuntimeError``). A peer that dies
    fails the receive at once, whatever the timeout: its connection closes."""
    return pickle.loads(_recv_bytes(group, src, tag, timeout))


def wait_all(pending: list[Any]) -> None:
    """Wait for the sends among ``pending`` (the rest are their buffers)."""
    for item in pending:
        if hasattr(item, "wait"):
            item.wait()


class Outbox:
    """Sends in flight and their buffers: at most ``keep`` of them (each what
    :func:`send_object` returned, or a version's sends). Adding one more waits for the
    oldest, which returns at once where the peer took it already: a protocol that knows how
    far behind its peer can be sets ``keep`` to that, so memory stays bounded and nothing
    waits. (gloo marks a send complete only inside ``wait``, so completion cannot be polled.)"""

    def __init__(self, keep: int = 1) -> None:
        self.keep = max(keep, 1)
        self.pending: list[list[Any]] = []

    def add(self, pending: list[Any]) -> None:
        self.pending.append(pending)
        while len(self.pending) > self.keep:
            wait_all(self.pending.pop(0))

    def flush(self, timeout: timedelta | None = None) -> None:
        """Wait until the peer took everything (each send at most ``timeout``)."""
        for pending in self.pending:
            for item in pending:
                if hasattr(item, "wait"):
                    item.wait(timeout or timedelta(0))  # 0: the group's own timeout
        self.pending = []


class StreamedEngine:
    """The training side's stand-in for an engine on another rank: what
    :class:`rollout.WeightSync` feeds on the rank that owns the link (the others pass
    ``engine=None``). ``update_weights`` sends the version's header (names, shapes, dtypes)
    and then each tensor, as it streams, to rank ``dst`` of ``group``; :func:`receive_weights`
    there loads them into the real engine.

    Ordering rules:
        1. Sends return at once; each version's tensors are copied to host memory (in the
           engine's dtype) and held until the receiver took them: at most ``keep`` versions,
           a further one waits for the oldest (none waits where the receiver is at most
           ``keep`` versions behind). :meth:`close` waits for all.
        2. The receiver takes versions in the order they were sent, and each whole.
        3. Nothing here generates: ``generate`` raises; ``sleep``/``wake_up`` are no-ops (the
           engine's memory is on the other rank).
    """

    def __init__(self, group: Any, dst: int, version: int = 0, keep: int = 1) -> None:
        self.group = group
        self.dst = dst
        self.policy_version = version
        self._outbox = Outbox(keep)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        # a host copy: gloo reads host memory, and the trainer's next step must not change it
        tensors = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]
        header = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
        pending = send_object(self.group, self.dst, (version, header), WEIGHTS_TAG)
        for _, tensor in tensors:
            raw = tensor.reshape(-1).view(torch.uint8)
            pending += [self.group.send([raw], self.dst, WEIGHTS_TAG), raw]
        self._outbox.add(pending)
        self.policy_version = version

    def generate(self, *args, **kwargs):
        raise RuntimeError("StreamedEngine: this rank generates nothing (a generating rank does)")

    def sleep(self) -> None:
        """No-op: the engine's memory is on the generating rank."""

    def wake_up(self) -> None:
        """No-op, as :meth:`sleep`."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Wait until the receiver took every version; one that is gone takes nothing."""
        with contextlib.suppress(RuntimeError):
            self._outbox.flush(timedelta(seconds=60))


def _tensors(group: Any, src: int, header: list) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, dtype in header:
        tensor = torch.empty(shape, dtype=dtype)
        group.recv([tensor.reshape(-1).view(torch.uint8)], src, WEIGHTS_TAG).wait()
        yield name, tensor


def receive_weights(group: Any, src: int, engine: Any) -> int:
    """Load the next version :class:`StreamedEngine` on rank ``src`` of ``group`` sent into
    ``engine`` (one tensor at a time, as it arrives); returns the version."""
    version, header = pickle.loads(_recv_bytes(group, src, WEIGHTS_TAG))
    engine.update_weights(_tensors(group, src, header), version=version)
    return version


class PeerWatch:
    """Names a peer that is gone at once, not at the next message this side waits for: a
    thread waits on a receive from ``peer`` that only :func:`release_watch` answers (a peer
    that ends on purpose). A peer that dies closes its connection, which fails that receive
    within milliseconds; ``on_lost`` gets the first line of gloo's error then, in that
    thread (so it should only record or log). A peer that hangs keeps its connection open:
    the receives of the protocol itself time out for it (the group's timeout)."""

    def __init__(self, group: Any, peer: int, on_lost: Callable[[str], None]) -> None:
        self.lost: str | None = None
        self._on_lost = on_lost
        self._flag = torch.zeros(1, dtype=torch.uint8)
        self._work = group.recv([self._flag], peer, WATCH_TAG)
        self._thread = threading.Thread(target=self._wait, name="klppo-peer-watch", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:  # far past the group's timeout: only an answer or a closed connection ends it
            self._work.wait(timedelta(days=365))
        except RuntimeError as err:
            self.lost = str(err).splitlines()[0] if str(err) else type(err).__name__
            self._on_lost(self.lost)

    def close(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` s for the peer's release (or its loss); whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def release_watch(group: Any, peer: int, timeout: timedelta | None = None) -> None:
    """Answer ``peer``'s :class:`PeerWatch` (this side ends on purpose) and wait until it
    took the answer, so that closing this process does not look like a death; a peer that
    is gone already is not waited for."""
    flag = torch.ones(1, dtype=torch.uint8)
    with contextlib.suppress(RuntimeError):
        group.send([flag], peer, WATCH_TAG).wait(timeout or timedelta(0))
