"""Rollouts from a rank of their own (``async_training.rollout_ranks``): the training rank's
:class:`RemoteRollouts` (a :class:`klppo_train.ppo.rollouts.RolloutSource`) and the
generating rank's loop, :func:`serve`.

The two talk over the gloo group that joins the world (:func:`klppo_train.runtime.
process_group.rollout_link`); sends return at once, receives block (:mod:`rollout.stream`).
Training rank 0 sends the orders, in this order: ``start`` (the step the run continues after,
and the loader's position then; to every generating rank, and each answers every training
rank it serves with ``up`` once its engine is built), then per step ``weights`` (followed by
the version's tensors, :class:`rollout.StreamedEngine`), ``validate`` where the loop
validates, ``stop`` at the end; every training rank takes the weights' gather
(:class:`rollout.WeightSync`). The generating rank splits each batch it generated over the
training ranks as data-parallel balancing would (:func:`klppo_train.ppo.balance.
split_groups`) and sends each its share, and each validation's results to all of them.

Ordering rules (the schedule of :class:`klppo_train.ppo.rollouts_ahead.RolloutsAhead`, now
overlapped):
    1. The generating rank generates batch j as soon as it holds version j − 1 − s (from the
       start: the starting weights), and never with any other version: it generates every
       batch it may before it takes the next order. So the batch of step k > s is version
       k − 1 − s's, exactly as in a colocated run with the same s, and s = 0 is the
       synchronous run.
    2. A ``validate`` order follows the weights of its step, so validation answers with the
       weights just trained (the batch generated next uses the same version).
    3. Each batch carries the generating rank's loader position after it; the training rank
       takes it as its own (its checkpoints hold it). A resumed run sends it back with
       ``start``, and the generating rank generates the steps after the checkpoint anew with
       the checkpoint's weights: the batches that were in flight are regenerated (younger
       than the bound allows), not saved.
    4. Nothing is generated for a step after ``last_step``.
    5. The link's timeout (``trainer.collective_timeout_s``) starts once both sides are up:
       the first order and ``up`` are waited for without it (they span the other side's
       build and probe, which have no bound of their own; a side that dies still fails
       them at once, its connection closed), every later receive times out. This holds per
       pair: with R > 1 the generating ranks' start-ups must end within the timeout of one
       another (the training ranks' first collectives and the first relay wait on them).
    6. Each side names the other when the link fails (:class:`klppo_train.runtime.
       process_group.LostRank`, one line). The training rank also watches the generating
       rank (:class:`rollout.PeerWatch`): one that dies is named at once, while the step in
       progress goes on (torchrun's SIGTERM then checkpoints it); ``stop`` is answered by
       :func:`rollout.release_watch`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

import torch

from fsdp_sharding import default_device
from klppo_train.data.datasets import PromptLoader
from klppo_train.ppo.balance import split_groups
from klppo_train.ppo.relay import next_order, take_weights
from klppo_train.ppo.rollouts import Collected, RolloutSource
from klppo_train.ppo.rollouts_ahead import staleness
from klppo_train.runtime.process_group import (
    PEER_FAILURE,
    START_UP_WAIT,
    SUMS,
    LostRank,
    RolloutLink,
)
from rollout import (
    Outbox,
    PeerWatch,
    WeightPublisher,
    recv_object,
    release_watch,
    send_object,
)

log = logging.getLogger("klppo_train")
VALIDATION_TAG = 13  # validation's results: a channel of their own (batches may come first)


@dataclass(frozen=True)
class Batch:
    """What the generating rank sends: the batch of ``step``, its loader position after it
    and how long it waited for the order before it (``idle_s``)."""

    step: int
    collected: Collected
    loader: dict[str, Any]
    idle_s: float


@dataclass
class RemoteRollouts:
    """The training rank's source: batches from the generating rank (module docstring);
    ``publisher``: a :class:`rollout.WeightSync` over a :class:`rollout.StreamedEngine`;
    ``loader``: the run's (checkpointed) loader, kept at the generating rank's position;
    ``rewards``: this rank's reward manager, which counts the generating rank's errors too."""

    link: RolloutLink
    publisher: WeightPublisher
    loader: PromptLoader
    lag: int = 0
    rewards: Any = None
    started: bool = False
    outbox: Outbox | None = None
    watch: PeerWatch | None = None

    def __post_init__(self) -> None:
        # an order is taken at the latest s + 1 steps after it was sent (≤ 2 orders a step)
        self.outbox = Outbox(2 * self.lag + 4)
        self.watch = PeerWatch(self.link.group, self.link.peer, self._lost)

    def _lost(self, line: str) -> None:
        """The watch's report: a closed connection (the rank died), or the pair closed by
        a receive that timed out (it hangs: stopped, or stuck in a call)."""
        hangs = "timeout" in line.lower()
        log.error("%s %s: %s", self._who(), "stopped answering" if hangs else "is gone", line)

    def _who(self) -> str:
        return f"rank {self.link.group.rank()}: the generating rank (rank {self.link.peer})"

    def _order(self, order: tuple) -> None:
        """Sent by training rank 0 alone (the others take the same steps); the first one to
        every generating rank, after which (unless it is ``stop``) each training rank waits
        until its own generating rank is up."""
        if not self.started and order[0] not in ("start", "stop"):
            self._order(("start", 0, None))
        first, self.started = not self.started, True
        if self.link.group.rank() == 0:
            to = self.link.generating() if first else [self.link.peer]
            with self._named():
                for rank in to:
                    self.outbox.add(send_object(self.link.group, rank, order))
        if first and order[0] == "start":
            with self._named():
                recv_object(self.link.group, self.link.peer, timeout=START_UP_WAIT)  # up

    @contextlib.contextmanager
    def _named(self, gathers: bool = False):
        """Link calls named (:func:`named_link`). ``gathers``: the call also gathers over
        the training ranks, so only a generating rank the watch saw go is named for it."""
        try:
            yield
        except RuntimeError as err:
            self.watch.close(timeout=1.0)  # it sees a closed connection within milliseconds
            if gathers and self.watch.lost is None:
                raise
            with named_link(self._who()):
                raise err from None

    def collect(self, items, step: int) -> Collected:
        """This rank's share of the batch of ``step`` (``items``, the training rank's own
        loader batch, is not used: the generating rank's loader gives the same one)."""
        if not self.started:
            self._order(("start", 0, None))
        start = time.perf_counter()
        with self._named():
            got: Batch = recv_object(self.link.group, self.link.peer)
        waited = time.perf_counter() - start
        if got.step != step:
            raise RuntimeError(f"rollout ranks: step {step} received the batch of {got.step}")
        self.loader.load_state_dict(got.loader)
        c = _moved(got.collected, default_device())
        errors = c.metrics.pop("reward/errors", 0.0)  # the generating rank's scoring
        if self.rewards is not None:  # the step reports this rank's count, now with them
            self.rewards.errors += int(errors)
        metrics = {
            **c.metrics,
            **staleness(c.trajectories, step),
            "async/trainer_idle_s": waited,
            "async/generator_idle_s": got.idle_s,
        }
        return Collected(c.items, c.trajectories, metrics, c.rule, c.baselines)

    def publish(self, version: int) -> dict[str, float]:
        self._order(("weights", version))
        with self._named(gathers=True):
            return self.publisher.sync(version=version)

    def resume(self, version: int) -> None:
        self._order(("start", version, self.loader.state_dict()))
        with self._named(gathers=True):
            self.publisher.sync(version=version)

    def generate(self, items, step: int, span: range):
        raise RuntimeError("rollout ranks: nothing generates on a training rank")

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """The generating rank's validation with the weights of ``step`` (every training
        rank gets the whole result)."""
        self._order(("validate", step))
        with self._named():
            return recv_object(self.link.group, self.link.peer, VALIDATION_TAG)

    def close(self) -> None:
        """``stop`` (rank 0), taken at once by a generating rank that waits for orders; one
        that is gone or stuck (the run failed mid-step) is left after a minute."""
        with contextlib.suppress(RuntimeError):
            self._order(("stop",))
            self.outbox.flush(timedelta(seconds=60))
        self.watch.close(timeout=60)


@contextlib.contextmanager
def named_link(who: str):
    """A link call that failed because its peer is gone or silent, as a :class:`LostRank`:
    ``who`` did not answer (one line); any other error goes on as it is."""
    try:
        yield
    except RuntimeError as err:
        if not PEER_FAILURE.search(str(err)):
            raise
        first = str(err).splitlines()[0]
        raise LostRank(f"{who} did not answer over the link: {first}") from None


@dataclass
class Serving:
    """The generating rank's side: ``source`` (colocated, dynamic sampling, ReMax's) over
    ``engine``, the run's ``loader``, ``validator()`` → validation's ``(metrics, rows)``;
    ``rewards``: the rule rewards the source scores with (their errors go with the batch)."""

    link: RolloutLink
    source: RolloutSource
    engine: Any
    loader: PromptLoader
    validator: Callable[[], tuple[dict[str, float], list[dict]]]
    lag: int
    last_step: int
    rewards: Any = None
    balance: bool = True
    sent: Outbox | None = None

    def __post_init__(self) -> None:
        # a batch is taken at the latest when the order after its step arrives
        self.sent = Outbox((self.lag + 3) * len(self.link.served()))

    def generate_until(self, version: int, step: int, idle_s: float) -> int:
        """Generate every batch from ``step`` on that ``version`` may (rule 1), each
        training rank its share (several generating ranks: each its own, balanced among
        them as colocated ranks balance theirs); the next step."""
        while step <= self.last_step and step - 1 - self.lag <= version:
            collected = _moved(self.source.collect(self.loader.next_batch(), step), "cpu")
            if self.rewards is not None:  # scored here (dynamic sampling, ReMax): counted there
                collected.metrics.update(self.rewards.metrics(reset=True))
            served = self.link.served()
            split = shares(collected, len(served), self.balance)
            for rank, share in zip(served, split, strict=True):
                batch = Batch(step, share, self.loader.state_dict(), idle_s)
                self.sent.add(send_object(self.link.group, rank, batch))
            step, idle_s = step + 1, 0.0
        return step

    def to_trainers(self, obj: Any, tag: int) -> None:
        for rank in self.link.served():
            self.sent.add(send_object(self.link.group, rank, obj, tag))


def shares(c: Collected, trainers: int, balance: bool = True) -> list[Collected]:
    """``c``, a whole batch, split over ``trainers`` data-parallel ranks (whole groups,
    tokens balanced; :func:`klppo_train.ppo.balance.split_groups`): each share's samples in
    its prompts' order, ``prompt_position`` their prompts' positions in the batch;
    ``balance=False``: equal runs of prompts in batch order."""
    if trainers == 1:
        return [c]
    t = c.trajectories
    split, spread = split_groups(t.prompt_index, t.attention_mask, len(c.items), trainers, balance)
    # the ranks' counts are summed (the engine's tokens, reward errors): the first one's alone
    counted = {k: v for k, v in c.metrics.items() if k not in SUMS}
    per_sample = [
        f.name for f in fields(t)
        if torch.is_tensor(getattr(t, f.name)) and len(getattr(t, f.name)) == len(t.prompt_index)
    ]  # fmt: skip
    out = []
    for positions in split:
        rows = torch.cat([torch.nonzero(t.prompt_index == p).flatten() for p in positions])
        sliced = {name: getattr(t, name)[rows] for name in per_sample}
        order = torch.tensor(positions, device=t.prompt_index.device)
        sliced["prompt_index"] = torch.searchsorted(order, t.prompt_index[rows])
        sliced["prompt_position"] = t.prompt_index[rows]
        share = replace(t, **sliced)
        balanced = {**(c.metrics if not out else counted), **spread}
        items = [c.items[p] for p in positions]
        out.append(Collected(items, share, balanced, _rows(c.rule, rows), _rows(c.baselines, rows)))
    return out


def _rows(v: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return v[rows] if v is not None else None


def _moved(c: Collected, device) -> Collected:
    """``c`` with its tensors on ``device`` (gloo carries host memory; each side its device)."""
    t = c.trajectories
    moved = {f.name: getattr(t, f.name) for f in fields(t)}
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in moved.items()}
    on = lambda v: v.to(device) if v is not None else None  # noqa: E731
    return replace(c, trajectories=replace(t, **moved), rule=on(c.rule), baselines=on(c.baselines))


def serve(s: Serving, start: tuple) -> int:
    """The generating rank's loop from the ``start`` order it received, until ``stop``; the
    last version it received. A peer that is gone is named (:func:`named_link`)."""
    with named_link(link_peers(s.link)):
        version = _serve(s, start)
    for rank in s.link.served():
        release_watch(s.link.group, rank)
    return version


def link_peers(link: RolloutLink) -> str:
    """Who a generating rank's failed call waited for (one training rank, one of several,
    or, with several generating ranks, one of either side)."""
    me = f"rank {link.group.rank()}"
    if link.generators > 1:
        return f"{me}: a training rank or another generating rank"
    if link.trainers > 1:
        return f"{me}: a training rank (ranks 0-{link.trainers - 1})"
    return f"{me}: the training rank (rank 0)"


def _serve(s: Serving, start: tuple) -> int:
    _, version, loader = start  # a first ``stop`` never gets here (generating_rank.generate)
    if loader is not None:
        s.loader.load_state_dict(loader)
    if version:
        version = take_weights(s.link, s.engine)
    step, idle = version + 1, 0.0
    while True:
        step = s.generate_until(version, step, idle)
        start = time.perf_counter()
        order = next_order(s.link)
        idle = time.perf_counter() - start
        if order[0] == "stop":
            break
        if order[0] == "weights":
            version = take_weights(s.link, s.engine)
        elif order[0] == "validate":
            s.to_trainers(s.validator(), VALIDATION_TAG)
    # Not flushed: the training rank took what it needed before ``stop`` (a batch past a
    # preempted run's last step is never taken, and the process ends with it).
    return version
